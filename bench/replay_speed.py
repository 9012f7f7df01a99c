"""`replay --no-model` against the model run: the time to replay tool-heavy
agent conversations under three policies, and that both give the same numbers.

    .venv/bin/python bench/replay_speed.py [--conversations 50] [--model-conversations 2] [--seed 0]

Builds `--conversations` seeded synthetic agent traces (JSONL, in a temporary
folder: 4 turns of 7 steps each, 6 tool calls a turn, reasoning on every step,
tool results of 40 to 300 words), then times, each as one `session-runtime
replay` process (start-up included), under keep, drop and keep_last_k:

- all of them with `--no-model` (target: under 60 s for 50 conversations);
- the first `--model-conversations` of them with the model and without, side
  by side, for the time per step of each and the equality of their reports;
- with `--baseline CHECKOUT` (another checkout of this repository, e.g. a
  `git worktree` of an earlier commit, run with this venv), the model run of
  that code on the same conversations, beside this code's.

Writes bench/results/replay_speed.json and .png. CPU only (the model run is
the `tiny` preset on this machine's cores).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from report import write_report  # noqa: E402  (bench/ is on sys.path when run)

REPO = Path(__file__).resolve().parents[1]
POLICIES = ("keep", "drop", "keep_last_k")
WORDS = ("alpha beta gamma delta file test error value return parse line module import call result check "
         "function class string number list index path read write open close run fix change").split()
TOOLS = [{"type": "function", "function": {"name": n, "description": f"{n} a file",
                                           "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}}
         for n in ("read_file", "grep", "edit_file", "run_tests")]


def text(rng: random.Random, lo: int, hi: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))


def conversation(rng: random.Random) -> list[dict]:
    lines = [{"type": "conversation", "system": text(rng, 250, 300), "tools": TOOLS}]
    for _ in range(4):
        lines.append({"role": "user", "content": text(rng, 10, 40)})
        for _ in range(6):
            call = {"name": rng.choice(TOOLS)["function"]["name"], "arguments": {"path": text(rng, 1, 3)}}
            lines.append({"role": "assistant", "reasoning": text(rng, 30, 120), "content": "",
                          "tool_calls": [call]})
            lines.append({"role": "tool", "content": text(rng, 40, 300)})
        lines.append({"role": "assistant", "reasoning": text(rng, 30, 120), "content": text(rng, 10, 60)})
    return lines


def replay(paths: list[Path], no_model: bool, report: Path, repo: Path = REPO) -> float:
    cmd = [sys.executable, "-m", "session_runtime.cli", "replay", *map(str, paths), "--no-progress",
           "--json", str(report), "--pool-tokens", "65536"]
    for p in POLICIES:
        cmd += ["--policy", p]
    if no_model:
        cmd.append("--no-model")
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, cwd=repo, stdout=subprocess.DEVNULL,
                   env={**os.environ, "PYTHONPATH": str(repo)})
    return time.perf_counter() - t0


def comparable(report: Path) -> list:
    """Every run's per-step figures but its timings."""
    out = []
    for trace in json.loads(report.read_text())["traces"]:
        for run in trace["runs"]:
            for turn in run["turns"]:
                out.append([{k: v for k, v in s.items() if not k.endswith("_ms")} for s in turn["step_accounting"]])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--conversations", type=int, default=50)
    ap.add_argument("--model-conversations", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--baseline", type=Path, help="another checkout whose model run to time beside this one's")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        paths = []
        for i in range(args.conversations):
            path = folder / f"agent_{i:03d}.jsonl"
            path.write_text("\n".join(json.dumps(line) for line in conversation(rng)) + "\n")
            paths.append(path)
        steps = args.conversations * 4 * 7
        few = paths[: args.model_conversations]
        few_steps = len(few) * 4 * 7
        t_all = replay(paths, True, folder / "all.json")
        t_few_model = replay(few, False, folder / "few_model.json")
        t_few_none = replay(few, True, folder / "few_none.json")
        equal = comparable(folder / "few_model.json") == comparable(folder / "few_none.json")
        t_baseline = replay(few, False, folder / "few_base.json", args.baseline) if args.baseline else None
    result = {
        "device": "cpu (2 cores)", "model": "tiny", "policies": list(POLICIES),
        "no_model": {"conversations": args.conversations, "steps": steps, "runs": steps * len(POLICIES),
                     "seconds": round(t_all, 2), "target_seconds": 60},
        "side_by_side": {"conversations": len(few), "steps": few_steps * len(POLICIES),
                         "model_seconds": round(t_few_model, 2), "no_model_seconds": round(t_few_none, 2),
                         "speedup": round(t_few_model / t_few_none, 1), "same_numbers": equal},
        "baseline": None if t_baseline is None else {
            "checkout": str(args.baseline), "model_seconds": round(t_baseline, 2),
            "this_over_baseline": round(t_few_model / t_baseline, 3)},
        "command": "bench/replay_speed.py " + " ".join(sys.argv[1:]),
    }
    print(json.dumps(result, indent=2))
    write_report("replay_speed", result, plot)


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s, n = result["side_by_side"], result["no_model"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    names, values, colors = ["model", "--no-model"], [s["model_seconds"], s["no_model_seconds"]], ["#c44", "#4a4"]
    if result.get("baseline"):
        names, values, colors = ["model (baseline)", *names], [result["baseline"]["model_seconds"], *values], \
            ["#999", *colors]
    a.bar(names, values, color=colors)
    a.set_title(f"{s['conversations']} conversations x {len(result['policies'])} policies "
                f"({s['steps']} steps), same numbers: {s['same_numbers']}")
    a.set_ylabel("seconds (one replay process, start-up included)")
    b.bar(["--no-model"], [n["seconds"]], color="#4a4")
    b.axhline(n["target_seconds"], color="k", linestyle="--", label=f"target {n['target_seconds']} s")
    b.set_title(f"{n['conversations']} conversations x {len(result['policies'])} policies ({n['runs']} steps)")
    b.legend()
    fig.suptitle(f"replay --no-model vs the model run ({result['device']}, model {result['model']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
