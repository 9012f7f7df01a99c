"""What our layer costs SGLang itself, per request.

    .venv/bin/python bench/sglang_request_cost.py [--forced 100] [--sampled 25] [--rounds 2]

Writes bench/results/sglang_request_cost.json and .png. A Runtime on the
SGLang backend launches a session server (`--radix-cache-backend session`,
the tiny model, this CPU) and runs one forced and one sampled first-turn step;
the /generate bodies its backend sent are kept. Then the same bodies are sent
again, one at a time, in three variants alternated in rounds: `full` (as the
runtime sends them: session_id, kv_hints with the chain's intent and the two
counterfactual probes, priority, extra_key), `no_hints` (without kv_hints),
and `bare` (raw /generate: none of them). For each, the CPU seconds SGLang's
processes spent per request (its scheduler, and the HTTP server's process,
where the tokenizer manager runs), from /proc.

What it answers: whether the session tree's work on a request (intake, the
chain's hold and lease, the probes, the report in meta_info) costs SGLang
measurable CPU beside the model's own work. Issue 21's gap between the
runtime and raw /generate at 8 agents is then looked for elsewhere (the
runtime's client process, see the JSON's notes).
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
import types
import uuid
from pathlib import Path

import orjson

_HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(_HERE))
sys.path.insert(0, str(_HERE.parent))
from procstat import cpu_s, stat_fields  # noqa: E402
from report import write_report  # noqa: E402

from session_runtime.backends.sglang.generate import sse_chunks  # noqa: E402

VARIANTS = {"full": (), "no_hints": ("kv_hints",),
            "bare": ("kv_hints", "session_id", "priority", "extra_key", "cache_salt")}


def group_cpu(pgid: int) -> dict[str, float]:
    """CPU seconds of each process of a process group, by process name."""
    out: dict[str, float] = {}
    for pid in os.listdir("/proc"):
        f = stat_fields(pid) if pid.isdigit() else None
        if f is None or int(f[2]) != pgid:
            continue
        try:
            name = Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            continue
        # comm is cut at 15 characters: sglang::schedul(er), sglang::detoken(izer)
        name = {"python": "http_server", "sglang::schedul": "scheduler", "sglang::detoken": "detokenizer"}.get(name, name)
        out[name] = out.get(name, 0.0) + cpu_s(f)
    return out


def send(http, body: dict) -> int:
    """One /generate, read to its end; returns the streamed chunks."""
    with http.post("/generate", orjson.dumps(body), {"content-type": "application/json"}) as resp:
        if resp.status >= 400:
            raise RuntimeError(f"/generate: HTTP {resp.status}: {resp.read()[:300]!r}")
        return sum(1 for _ in sse_chunks(resp.iter_lines()))


def window(http, pgid: int, body: dict, n: int) -> dict:
    before, t0 = group_cpu(pgid), time.perf_counter()
    chunks = 0
    for _ in range(n):
        b = dict(body)
        if "kv_hints" in b:  # every request its own message id, as the runtime's
            b["kv_hints"] = {**b["kv_hints"], "message_id": uuid.uuid4().hex}
        chunks += send(http, b)
    wall, after = time.perf_counter() - t0, group_cpu(pgid)
    return {"requests": n, "wall_ms_per_request": round(wall / n * 1e3, 2), "chunks_per_request": chunks / n,
            "cpu_ms_per_request": {k: round((after[k] - before.get(k, 0.0)) / n * 1e3, 2) for k in after}}


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = list(result["kinds"])
    fig, axes = plt.subplots(1, len(kinds), figsize=(6 * len(kinds), 4.5), squeeze=False)
    for ax, kind in zip(axes[0], kinds):
        rows = result["kinds"][kind]["median_cpu_ms_per_request"]
        names = list(rows)
        procs = sorted({p for r in rows.values() for p in r})
        bottom = [0.0] * len(names)
        for p in procs:
            vals = [rows[n].get(p, 0.0) for n in names]
            ax.bar(names, vals, bottom=bottom, label=p)
            bottom = [a + b for a, b in zip(bottom, vals)]
        ax.set(title=f"{kind}: SGLang CPU per request", ylabel="ms (median over rounds)")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--forced", type=int, default=100, help="forced (prefill-only) requests per window")
    ap.add_argument("--sampled", type=int, default=25, help="sampled (32 new tokens) requests per window")
    ap.add_argument("--rounds", type=int, default=2, help="alternations of the three variants")
    ap.add_argument("--model-dir", default=str(Path.home() / ".cache" / "session-runtime" / "models"))
    ap.add_argument("--name", default="sglang_request_cost")
    args = ap.parse_args()
    os.chdir(_HERE.parent)  # the server runs `python -m sglang...` from the cwd
    os.environ["OMP_NUM_THREADS"] = "1"  # as bench/sglang_server.py: steadiest on a shared 2-core host

    import sglang_server as S

    from session_runtime.config import RuntimeConfig
    from session_runtime.direct_http import DirectPool
    from session_runtime.model.export import export_preset
    from session_runtime.runtime import Runtime
    from session_runtime.tokenizer import load_tokenizer

    tok = load_tokenizer("tiny")
    folder = export_preset("tiny", 0, Path(args.model_dir), min_vocab=tok.vocab_size)
    rt = Runtime(RuntimeConfig(model=str(folder), backend="sglang", page_size=16, pool_tokens=262144,
                               max_context=32768, template="deepseek", data_dir=None, offload="never", seed=0,
                               sglang_max_running=32), background=True)
    bodies: list[dict] = []
    stream = rt.backend._stream

    def keep_body(body, cancel=None):
        bodies.append(copy.deepcopy(body))
        return stream(body, cancel)

    result: dict = {"command": "python bench/sglang_request_cost.py " + " ".join(sys.argv[1:]),
                    "machine": {"cores": os.cpu_count(), "gpu": None}, "kinds": {}}
    try:
        server = rt.backend.server
        pgid = os.getpgid(server.process.pid)
        rt.backend._stream = keep_body
        S.warm_runtime(rt, types.SimpleNamespace(seed=0, b_system_words=160, b_user_words=30), 2)
        system, user = S.b_prompt(0, 0, 1, 160, 30)
        for kind, forced in (("forced", S.b_forced(0)), ("sampled", None)):
            cid = rt.create_conversation(f"[{kind}] " + system, policy="drop", materialize="never")
            rt.send_message(cid, user, max_tokens=S.NEW_TOKENS, temperature=0.0, forced=forced)
            body = bodies[-1]
            rt.backend._stream = stream
            http = DirectPool(server.url)
            n = args.forced if forced is not None else args.sampled
            window(http, pgid, body, max(2, n // 10))  # warm
            rounds: dict[str, list] = {v: [] for v in VARIANTS}
            for k in range(args.rounds):
                for v in list(VARIANTS) if k % 2 == 0 else list(VARIANTS)[::-1]:
                    b = {key: val for key, val in body.items() if key not in VARIANTS[v]}
                    rounds[v].append(window(http, pgid, b, n))
                    print(kind, v, rounds[v][-1], flush=True)
            http.close()
            rt.backend._stream = keep_body
            procs = sorted({p for rs in rounds.values() for r in rs for p in r["cpu_ms_per_request"]})
            med = {v: {p: round(statistics.median(r["cpu_ms_per_request"].get(p, 0.0) for r in rs), 2) for p in procs}
                   for v, rs in rounds.items()}
            total = {v: round(sum(m.values()), 2) for v, m in med.items()}
            result["kinds"][kind] = {
                "body_keys": sorted(body), "kv_hints": body.get("kv_hints"), "prompt_tokens": len(body["input_ids"]),
                "rounds": rounds, "median_cpu_ms_per_request": med, "median_total_cpu_ms": total,
                "full_over_bare": round(total["full"] / total["bare"], 3)}
    finally:
        rt.close()
    result["notes"] = ("Requests are sent one at a time from this process, the same body each time (its prompt "
                       "cached after the first), so the figures are SGLang's work per request beside the model's. "
                       "CPU from /proc (10 ms ticks, summed over the window). The machine's speed drifts by "
                       "10% within minutes here: compare variants within a round.")
    js, png = write_report(args.name, result, plot)
    print({k: v["median_total_cpu_ms"] for k, v in result["kinds"].items()})
    print("wrote", js, png)


if __name__ == "__main__":
    main()
