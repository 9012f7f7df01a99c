"""Throughput with 1 and 2 SGLang workers behind one runtime (issue 11).

    .venv/bin/python bench/workers.py [--conversations 8] [--turns 3] [--tokens 32]

Writes bench/results/workers.json and bench/results/workers.png.

For each worker count the runtime launches that many SGLang servers (tiny
preset, CPU, `--workers N`), places `--conversations` conversations on them
(consistent hashing with bounded loads) and drives them from one thread each:
`--turns` turns of `--tokens` greedy sampled tokens. Reported: steps/s and
output tokens/s over the timed part (after one warm-up turn), the placement,
and how many cores the workers shared. On this 2-core machine the servers
share the same two cores, so no speed-up is expected; the figure matters on
hardware with a core (or GPU) per worker.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from pathlib import Path

from report import write_report  # noqa: E402  (bench/ is on sys.path when run)

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def run(workers: int, conversations: int, turns: int, tokens: int) -> dict:
    from session_runtime import Runtime, RuntimeConfig

    t0 = time.perf_counter()
    rt = Runtime(RuntimeConfig(model="tiny", backend="sglang", workers=workers, page_size=16, pool_tokens=8192,
                               max_context=4096, template="deepseek", data_dir=None, offload="never", idle_ttl_s=0),
                 background=False)
    start_s = time.perf_counter() - t0
    try:
        cids = [rt.create_conversation(system=f"Worker bench conversation {i}. " * 4) for i in range(conversations)]
        for cid in cids:  # warm-up turn: the chains exist, the servers have run once
            rt.send_message(cid, "Warm up.", max_tokens=4)
        placement = {cid: rt.describe(cid)["worker"] for cid in cids}
        steps, out_tokens, errors = [0], [0], []
        lock = threading.Lock()

        def drive(cid: str) -> None:
            try:
                for t in range(turns):
                    s = rt.send_message(cid, f"Turn {t}: go on.", max_tokens=tokens)
                    with lock:
                        steps[0] += 1
                        out_tokens[0] += s.accounting.output_tokens
            except Exception as exc:  # noqa: BLE001 - reported in the results
                errors.append(repr(exc))

        threads = [threading.Thread(target=drive, args=(c,)) for c in cids]
        t1 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t1
    finally:
        rt.close()
    per_worker = {w: list(placement.values()).count(w) for w in sorted(set(placement.values()))}
    return {"workers": workers, "start_s": round(start_s, 1), "wall_s": round(wall, 2), "steps": steps[0],
            "output_tokens": out_tokens[0], "steps_per_s": round(steps[0] / wall, 3),
            "tokens_per_s": round(out_tokens[0] / wall, 2), "conversations_per_worker": per_worker, "errors": errors}


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = result["runs"]
    fig, ax = plt.subplots(figsize=(6, 4.2))
    ax.bar([str(r["workers"]) for r in runs], [r["tokens_per_s"] for r in runs])
    ax.set_xlabel("SGLang workers")
    ax.set_ylabel("output tokens/s (all conversations)")
    ax.set_title(f"{result['conversations']} conversations, {result['tokens']} tokens a step, "
                 f"{result['cores']} shared cores")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=32)
    args = ap.parse_args()
    runs = [run(n, args.conversations, args.turns, args.tokens) for n in (1, 2)]
    result = {"device": "cpu", "cores": os.cpu_count(), "conversations": args.conversations, "turns": args.turns,
              "tokens": args.tokens, "runs": runs, "ratio_2_over_1": round(runs[1]["tokens_per_s"] /
                                                                          runs[0]["tokens_per_s"], 3),
              "notes": ("both workers are SGLang servers on the same CPU cores as each other and the runtime; "
                        "greedy sampled decode; timed after one warm-up turn per conversation")}
    js, png = write_report("workers", result, plot)
    print({r["workers"]: (r["tokens_per_s"], r["conversations_per_worker"], r["errors"][:1]) for r in runs},
          "ratio", result["ratio_2_over_1"], "->", js, png)


if __name__ == "__main__":
    main()
