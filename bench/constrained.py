"""What a constraint costs: steps/s with and without a JSON-schema answer, side by side.

    .venv/bin/python bench/constrained.py [--model tiny] [--device cpu|cuda] [--rounds 8] [--tokens 48]
                                          [--backend embedded|sglang]

Writes bench/results/constrained.json and constrained.png. Each round runs,
interleaved on one runtime (so the machine's noise falls on both alike), a
free step and a step whose answer must follow a JSON schema, each a new
conversation's first step with the same prompt, each `--tokens` output
tokens at most: the free step runs to its cap (the tiny model's random
weights never end their reasoning), the constrained one, its reasoning closed
at once so every token is under the grammar, may end sooner when its JSON
closes, so both are compared per output token. Reported: steps/s normalized to the same output length
(tokens/s over tokens), the ratio constrained/free, and the first
constrained step's extra cost (the grammar compiled; later steps of the same
schema reuse it). Target (issue 39): the constraint costs at most 10% of
steps/s on the embedded engine; on `--backend sglang` no more than SGLang's own
cost for the same structural tag sent to its raw /generate, timed beside ours
(`raw_generate`).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

from report import write_report  # noqa: E402  (bench/ is on sys.path when run)

SCHEMA = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 24},
    "days": {"type": "array", "items": {"type": "object", "properties": {
        "t": {"type": "integer", "minimum": -50, "maximum": 50}, "sky": {"enum": ["sun", "rain", "snow"]}},
        "required": ["t", "sky"], "additionalProperties": False}, "maxItems": 7},
    "ok": {"type": "boolean"}}, "required": ["city", "days", "ok"], "additionalProperties": False}
TARGET = 0.90  # constrained steps/s at least this share of free steps/s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--backend", default="embedded", choices=["embedded", "sglang"])
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=48)
    args = ap.parse_args()

    from session_runtime.config import RuntimeConfig
    from session_runtime.constrained.spec import OutputConstraint
    from session_runtime.runtime import Runtime

    rt = Runtime(RuntimeConfig(model=args.model, device=args.device, backend=args.backend, pool_tokens=16384,
                               max_context=2048, data_dir=None, offload="never"), background=False)
    constraint = OutputConstraint(answer_schema=json.dumps(SCHEMA), think_budget=0)
    prompt = "Report the weather for the week as JSON."

    def run(c=None) -> tuple[float, int]:
        cid = rt.create_conversation("You report weather.")
        t0 = time.perf_counter()
        step = rt.send_message(cid, prompt, max_tokens=args.tokens, **({"constraint": c} if c else {}))
        elapsed = time.perf_counter() - t0
        rt.delete_conversation(cid)
        return elapsed, len(step.output_ids)

    raw = None
    try:
        run()  # warm: the model's first forwards
        first = run(constraint)  # the schema's grammar compiled (and the compiler built) here
        free, constrained = [], []
        for _ in range(args.rounds):
            free.append(run())
            constrained.append(run(constraint))
        if args.backend == "sglang":
            raw = raw_generate(rt, constraint, args)
    finally:
        rt.close()

    def per_step(samples: list[tuple[float, int]]) -> dict:
        """Steps/s at `--tokens` output tokens each (the median seconds per token times the tokens)."""
        per_token = statistics.median(s / max(n, 1) for s, n in samples)
        return {"steps_per_s": 1.0 / (per_token * args.tokens), "ms_per_token": per_token * 1e3,
                "tokens": [n for _, n in samples], "seconds": [round(s, 4) for s, _ in samples]}

    a, b = per_step(free), per_step(constrained)
    ratio = b["steps_per_s"] / a["steps_per_s"]
    if raw is not None:  # SGLang's own cost of the same constraint on raw /generate, beside ours
        raw = {"free": per_step(raw[0]), "constrained": per_step(raw[1])}
        raw["ratio"] = raw["constrained"]["steps_per_s"] / raw["free"]["steps_per_s"]
    result = {
        "bench": "constrained", "backend": args.backend, "device": args.device, "model": args.model,
        "machine": platform.machine(), "rounds": args.rounds, "tokens": args.tokens, "schema": SCHEMA,
        "free": a, "constrained": b, "ratio": ratio, "target": TARGET, "meets_target": ratio >= TARGET,
        "first_constrained_step_s": first[0], "first_constrained_tokens": first[1],
    }
    if raw is not None:
        result["raw_generate"] = raw
        result["meets_target"] = ratio >= raw["ratio"] - 0.02  # on SGLang: no more than its own cost (noise: 2%)
    js, png = write_report("constrained" if args.backend == "embedded" else f"constrained_{args.backend}",
                           result, plot)
    print(json.dumps({k: v for k, v in result.items() if k not in ("schema",)}, indent=2))
    print(f"wrote {js} and {png}")


def raw_generate(rt, constraint, args) -> tuple[list, list]:
    """SGLang's own cost of the same constraint: the same structural tag sent
    to the server's raw /generate (input ids, no session runtime), free and
    constrained interleaved, as (seconds, output tokens) pairs."""
    import httpx

    from session_runtime.constrained import grammar

    tpl = rt.template(rt.config.template if rt.config.template != "auto" else "deepseek")
    tag = grammar.whole_tag(grammar.structural_tag(tpl, [], constraint), grammar.end_think(tpl), 0,
                            sorted(tpl.stop_token_ids))
    ids = rt.tokenizer.encode_text("You report weather. Report the weather for the week as JSON.")
    url = rt.backend.url

    def generate(constrained: bool) -> tuple[float, int]:
        params = {"max_new_tokens": args.tokens, "temperature": 0.0, "stop_token_ids": sorted(tpl.stop_token_ids)}
        if constrained:
            params["structural_tag"] = tag
        t0 = time.perf_counter()
        out = httpx.post(f"{url}/generate", json={"input_ids": ids, "sampling_params": params}, timeout=600).json()
        return time.perf_counter() - t0, len(out["output_ids"])

    generate(True)  # its grammar compiled on the server
    free, constrained = [], []
    for _ in range(args.rounds):
        free.append(generate(False))
        constrained.append(generate(True))
    return free, constrained


def plot(result: dict, path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    names = ["free", "JSON schema"]
    values = [result["free"]["steps_per_s"], result["constrained"]["steps_per_s"]]
    colors = ["#888", "#3a7"]
    if "raw_generate" in result:
        raw = result["raw_generate"]
        names += ["raw /generate free", "raw /generate JSON"]
        values += [raw["free"]["steps_per_s"], raw["constrained"]["steps_per_s"]]
        colors += ["#bbb", "#9c9"]
    ax.bar(names, values, color=colors)
    ax.axhline(result["free"]["steps_per_s"] * result["target"], color="r", ls="--", label="target (90% of free)")
    ax.set_ylabel(f"steps/s at {result['tokens']} output tokens")
    ax.set_title(f"{result['backend']} on {result['device']} ({result['model']}): constrained/free = "
                 f"{result['ratio']:.2f}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
