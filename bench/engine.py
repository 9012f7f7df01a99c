"""Engine benchmark: prefill/decode speed and the session layer's share of a step.

    .venv/bin/python bench/engine.py [--device cpu|cuda] [--model tiny] [--contexts 1024,8192,32768]
                                     [--attention auto|sdpa|flashinfer|paged-reference]

Writes bench/results/engine.json (with the attention backend that ran) and
bench/results/engine.png. One conversation is grown through the context sizes
in order (forced empty output, so growth is pure prefill), and at each size
several agent steps are timed: the previous sequence plus 16 new tokens, then
8 greedy decode tokens. `session_ms` is the
engine's own split: step time minus decoder forwards and sampling.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import platform
import pstats
import random
import statistics
import time
from pathlib import Path
from typing import Callable

import torch

from radix_ext.tree import Namespace
from session_runtime.config import ATTENTION_BACKENDS, RuntimeConfig
from session_runtime.backends.embedded.engine import Engine, StepRequest
from session_runtime.model.weights import decoder_for
from session_runtime.sampling import SamplingParams

from report import RESULTS, write_report  # noqa: E402  (bench/ is on sys.path when run)
VOCAB, EOS = 129280, 1
TARGET_PCT, TARGET_CTX = 5.0, 8192
NS = Namespace(extra_key="bench")
STEP_WRAPPERS = {"step", "_step_locked", "_run"}  # contain the model time too
Tokens = Callable[[int], list[int]]


def token_source(seed: int) -> Tokens:
    """Seeded random token ids in [2, VOCAB): never the eos (1)."""
    rng = random.Random(seed)
    return lambda n: [rng.randrange(EOS + 1, VOCAB) for _ in range(n)]


def build_engine(args, max_ctx: int) -> Engine:
    cfg = RuntimeConfig(model=args.model, device=args.device, dtype=args.dtype, attention=args.attention,
                        page_size=16, max_context=max_ctx + 4096, pool_tokens=max_ctx + 16384,
                        host_pool_tokens=0)  # no offload here: pin no host memory
    return Engine(cfg, decoder_for(cfg))


def step(eng: Engine, owner: str, prompt: list[int], max_tokens: int = 0, forced=None):
    return eng.step(StepRequest(owner=owner, prompt=prompt, namespace=NS,
                                sampling=SamplingParams(max_tokens=max_tokens), forced=forced))


def bench_speed(eng: Engine, toks: Tokens, prefill_len: int, decode_len: int, reps: int) -> dict:
    """Cold prefill of `prefill_len` fresh tokens, then a greedy decode; medians over reps."""
    step(eng, "warmup", toks(prefill_len), max_tokens=4)
    eng.release("warmup")
    runs = []
    for i in range(reps):
        r = step(eng, f"speed{i}", toks(prefill_len), max_tokens=decode_len)
        assert r.accounting.cached_input_tokens == 0 and len(r.output) == decode_len
        runs.append(r.accounting)
        eng.release(f"speed{i}")
    p, d = statistics.median(a.prefill_ms for a in runs), statistics.median(a.tpot_ms for a in runs)
    return {"prefill_tokens": prefill_len, "decode_tokens": decode_len, "reps": reps,
            "prefill_ms": p, "tpot_ms": d,
            "prefill_tok_s": prefill_len / p * 1e3, "decode_tok_s": 1e3 / d}


def grow(eng: Engine, toks: Tokens, seq: list[int], target: int, chunk: int = 8192) -> list[int]:
    """Extend the conversation's chain to about `target` tokens with prefill-only steps."""
    while len(seq) < target:
        r = step(eng, "conv", seq + toks(min(chunk, target - len(seq))), forced=[])
        seq = r.sequence
    return seq


def profile_step(eng: Engine, toks: Tokens, seq: list[int], top: int = 15) -> tuple[list[int], list[dict]]:
    """cProfile one agent step; the top session-side functions by cumulative time.
    Functions reachable from `_forward` or the sampler (model time, as the engine
    splits it) and the wrappers around the whole step are left out."""
    prof = cProfile.Profile()
    prompt = seq + toks(16)
    prof.enable()
    r = step(eng, "conv", prompt, max_tokens=8)
    prof.disable()
    stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]
    callees: dict = {}
    for k, v in stats.items():
        for caller in v[4]:
            callees.setdefault(caller, []).append(k)
    todo = [k for k in stats if k[2] in ("_forward", "sample")]
    model = set(todo)
    while todo:  # everything reachable from a forward or the sampler is model time
        for k in callees.get(todo.pop(), ()):
            if k not in model:
                model.add(k)
                todo.append(k)
    rows = [{"function": f"{Path(f).name}:{line}({fn})", "ncalls": v[1], "tottime_ms": v[2] * 1e3,
             "cumtime_ms": v[3] * 1e3}
            for (f, line, fn), v in stats.items()
            if (f, line, fn) not in model and f != "~" and fn not in STEP_WRAPPERS]
    rows.sort(key=lambda x: -x["cumtime_ms"])
    return r.sequence, rows[:top]


def bench_contexts(eng: Engine, toks: Tokens, contexts: list[int], steps: int, force_profile: bool) -> list[dict]:
    out, seq = [], []
    for ctx in contexts:
        t = time.perf_counter()
        seq = grow(eng, toks, seq, ctx)
        grow_s = time.perf_counter() - t
        seq = step(eng, "conv", seq + toks(16), max_tokens=8).sequence  # warm-up at this size
        runs = []
        for _ in range(steps):
            prompt = seq + toks(16)
            t = time.perf_counter()
            r = step(eng, "conv", prompt, max_tokens=8)
            wall = (time.perf_counter() - t) * 1e3  # adds eng.step()'s validation, run before its timer
            assert r.accounting.cached_input_tokens >= len(seq) // 16 * 16
            tm = r.timing
            runs.append({"prompt_tokens": r.accounting.prompt_tokens, "total_ms": tm.total_ms,
                         "model_ms": tm.model_ms, "session_ms": tm.session_ms,
                         "session_pct": tm.session_ms / tm.total_ms * 100,
                         "wall_ms": wall, "wall_session_pct": (wall - tm.model_ms) / wall * 100})
            seq = r.sequence
        row = {"context": ctx, "steps": steps, "grow_s": grow_s}
        row |= {k: statistics.median(x[k] for x in runs) for k in runs[0]}  # medians per field
        total, model, session, pct = (row[k] for k in ("total_ms", "model_ms", "session_ms", "session_pct"))
        if ctx == TARGET_CTX and (force_profile or pct > TARGET_PCT):
            seq, row["profile_top"] = profile_step(eng, toks, seq)
        out.append(row)
        print(f"  ctx {ctx:>6}: total {total:8.1f} ms  model {model:8.1f} ms  "
              f"session {session:6.2f} ms ({pct:.2f}%)  [grow {grow_s:.1f}s]", flush=True)
    return out


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sp, rows = result["speed"], result["contexts"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.8))
    vals = [sp["prefill_tok_s"], sp["decode_tok_s"]]
    bars = a.bar([f"prefill\n({sp['prefill_tokens']} tok cold)", f"decode\n({sp['decode_tokens']} tok greedy)"],
                 vals, color=["tab:blue", "tab:orange"])
    a.set_yscale("log")
    a.set_ylabel("tokens / s (log)")
    a.set_title("(a) throughput, median")
    for bar, v in zip(bars, vals):
        a.annotate(f"{v:,.0f}" if v >= 100 else f"{v:.1f}", (bar.get_x() + bar.get_width() / 2, v), ha="center", va="bottom")
    labels = [f"{r['context'] / 1024:g}k" for r in rows]
    model = [r["model_ms"] for r in rows]
    session = [r["session_ms"] for r in rows]
    b.bar(labels, model, label="model (forwards + sampling)", color="tab:blue")
    b.bar(labels, session, bottom=model, label="session (tree, locks, bookkeeping)", color="tab:red")
    for i, r in enumerate(rows):
        b.annotate(f"{r['session_ms']:.2f} ms\n{r['session_pct']:.2f}%", (i, r["total_ms"]),
                   ha="center", va="bottom", fontsize=9)
    b.set_ylim(0, max(r["total_ms"] for r in rows) * 1.25)
    b.set_xlabel("context (tokens in chain)")
    b.set_ylabel("ms per agent step (median)")
    b.set_title(f"(b) agent step: +16 prompt, 8 decode; target < {TARGET_PCT:g}% at 8k")
    b.legend(loc="upper center", bbox_to_anchor=(0.5, -0.15), ncol=2, fontsize=8)
    where = result["gpu"] if result["device"] == "cuda" else f"{result['threads']} torch threads"
    fig.suptitle(f"engine benchmark: model {result['model']} on {result['device']} ({where}), "
                 f"attention {result['attention']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                    help="default: float32 on cpu, bfloat16 on cuda")
    ap.add_argument("--attention", default=RuntimeConfig.attention, choices=ATTENTION_BACKENDS,
                    help="auto: flashinfer on cuda where it runs, else torch SDPA")
    ap.add_argument("--contexts", default="1024,8192,32768", help="comma-separated context sizes, in tokens")
    ap.add_argument("--steps", type=int, default=5, help="timed agent steps per context")
    ap.add_argument("--reps", type=int, default=5, help="repetitions of the speed test")
    ap.add_argument("--profile", action="store_true", help="cProfile a step at 8k even if the target is met")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    args = ap.parse_args()
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    contexts = sorted(int(c) for c in args.contexts.split(","))
    if args.threads:
        torch.set_num_threads(args.threads)
    t0, load0 = time.perf_counter(), os.getloadavg()[0]
    eng = build_engine(args, max(contexts))
    toks = token_source(args.seed)
    print(f"engine built on {args.device}, attention {eng.decoder.attention.name} "
          f"({time.perf_counter() - t0:.1f}s)", flush=True)
    speed = bench_speed(eng, toks, prefill_len=2048, decode_len=64, reps=args.reps)
    print(f"  prefill {speed['prefill_tok_s']:,.0f} tok/s, decode {speed['decode_tok_s']:,.1f} tok/s", flush=True)
    rows = bench_contexts(eng, toks, contexts, args.steps, args.profile)
    eng.release("conv")
    eng.check_integrity()
    at_target = next((r for r in rows if r["context"] == TARGET_CTX), None)
    result = {
        "device": args.device, "model": args.model, "dtype": args.dtype,
        "attention": eng.decoder.attention.name,  # the backend that ran ("auto" resolved)
        "torch": torch.__version__, "threads": torch.get_num_threads(), "host": platform.processor() or platform.machine(),
        "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None,
        "config": {k: getattr(eng.config, k) for k in ("page_size", "pool_tokens", "max_context", "prefill_chunk", "dtype")},
        "speed": speed, "contexts": rows,
        "target_pct": TARGET_PCT, "target_context": TARGET_CTX,
        "met": None if at_target is None else at_target["session_pct"] < TARGET_PCT,
        "wall_s": time.perf_counter() - t0,
        "loadavg_1m": {"start": load0, "end": os.getloadavg()[0]},  # other processes skew CPU timings
    }
    write_report("engine", result, plot)
    print(f"met={result['met']}  wall {result['wall_s']:.1f}s  -> {RESULTS}/engine.json, engine.png")


if __name__ == "__main__":
    main()
