"""`session-runtime replay`: arguments and the command."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from session_runtime.policies import MATERIALIZE_MODES, POLICIES


from session_runtime.replay.batch import aggregate, describe_aggregate, describe_trace, load_traces, replay_all, trace_line
from session_runtime.replay.formats import FORMATS, collect_paths
from session_runtime.replay.run import COMPARE, ReplayError, RunSpec, parse_run_spec
from session_runtime.replay.report import LEGEND, Progress
from session_runtime.replay import analysis


# ----- the CLI command ---------------------------------------------------------------------


def add_arguments(parser) -> None:
    """The `replay` subcommand's flags (cli.py builds the subparser)."""
    from session_runtime.config import PRESETS, RuntimeConfig

    d = RuntimeConfig()
    parser.add_argument("traces", nargs="+", metavar="TRACE",
                        help="trace files, folders (every .json/.jsonl file in one) or globs; "
                             "formats in examples/TRACE_FORMAT.md")
    parser.add_argument("--format", default="auto", choices=("auto", *FORMATS),
                        help="the traces' format (default: detected per file)")
    parser.add_argument("--policy", action="append", default=None, metavar="POLICY[:MATERIALIZE]",
                        help=f"policy to replay under; repeat to compare ({', '.join(POLICIES)}); "
                             "a suffix such as drop:never sets that run's materialize mode (default: drop)")
    parser.add_argument("--compare", action="store_true",
                        help=f"replay under {', '.join(COMPARE)} (after any --policy)")
    parser.add_argument("--keep-last-k", type=int, default=1, help="k of keep_last_k")
    parser.add_argument("--materialize", default="auto", choices=MATERIALIZE_MODES,
                        help="materialize mode of runs that do not set one")
    parser.add_argument("--model", default=d.model, help=f"a preset ({', '.join(PRESETS)}) or a local HF folder")
    parser.add_argument("--template", default=d.template, choices=["auto", "deepseek", "qwen3"])
    parser.add_argument("--device", default=d.device)
    parser.add_argument("--dtype", default=d.dtype)
    parser.add_argument("--page-size", type=int, default=d.page_size)
    parser.add_argument("--pool-tokens", type=int, default=d.pool_tokens)
    parser.add_argument("--max-context", type=int, default=None, help="default: the model's own limit")
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument("--no-model", action="store_true",
                        help="run no model: every step's output is forced, so the accounting depends only on the "
                             "tokens, the page size and the pool; the same numbers, at the speed of tokenization "
                             "(the model's shape still sizes the pools and the KV figures)")
    parser.add_argument("--json", metavar="PATH", help="also write every run's per-step accounting as JSON")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    parser.add_argument("--skip-bad", action="store_true",
                        help="go on past a file that is not a trace (the report names each one skipped) "
                             "instead of stopping")
    analysis.add_arguments(parser)  # --cost-model, the clock, --plot


def run_specs(args) -> list[RunSpec]:
    """RunSpecs from --policy/--compare in order, each run once. Raises ValueError."""
    texts = list(args.policy or [])
    if args.compare:
        texts += list(COMPARE)
    specs: list[RunSpec] = []
    for text in texts or ["drop"]:
        spec = parse_run_spec(text, args.materialize, args.keep_last_k)
        if spec not in specs:  # the same run twice replays the same numbers
            specs.append(spec)
    return specs


def run_command(args, out=None, err=None) -> int:
    """`session-runtime replay`: validate every trace, then build the Runtime (slow) once."""
    out, err = out or sys.stdout, err or sys.stderr
    if args.keep_last_k < 0:
        print("session-runtime replay: --keep-last-k must be >= 0", file=err)
        return 2
    try:
        specs = run_specs(args)
        traces, errors = load_traces(collect_paths(args.traces), args.format)
    except (OSError, ValueError) as exc:
        print(f"session-runtime replay: {exc}", file=err)
        return 2
    for e in errors:
        print(f"session-runtime replay: {'skipped ' if args.skip_bad else ''}{e}", file=err)
    if errors and not (args.skip_bad and traces):
        if args.skip_bad:
            print("session-runtime replay: no file is a trace", file=err)
        return 2

    from session_runtime.config import RuntimeConfig
    from session_runtime.errors import RuntimeErrorBase

    try:
        config = RuntimeConfig(model=args.model, device=args.device, dtype=args.dtype, page_size=args.page_size,
                               pool_tokens=args.pool_tokens, max_context=args.max_context, seed=args.seed,
                               template=args.template, run_model=not args.no_model,
                               # A trace's tools are replayed as recorded: the serving limits
                               # protect a shared server from its tenants, not from a local file.
                               max_tools=0, max_tools_bytes=0, max_tenant_bytes=0)
        cost, clock = analysis.settings(args, config.prefill_chunk)
        price = analysis.kv_price(args, cost)
        # Policy auto prices its choices as the verdict prices the runs.
        config = config.replace(cost_model=args.cost_model or args.model, cost_dtype=args.cost_dtype,
                                kv_price=price[0])
    except ValueError as exc:
        print(f"session-runtime replay: {exc}", file=err)
        return 2
    what = trace_line(traces[0]) if len(traces) == 1 else f"{len(traces)} traces"
    print(f"session-runtime replay: {what}; loading {config.model} ...", file=err, flush=True)
    import warnings

    warnings.filterwarnings("ignore", module="sglang")
    from session_runtime.runtime import Runtime

    progress = None
    try:
        rt = Runtime(config, background=False)
    except RuntimeErrorBase as exc:
        print(f"session-runtime replay: {exc}", file=err)
        return 2
    try:
        progress = Progress(sum(t.n_steps for t in traces) * len(specs), enabled=not args.no_progress, stream=err)
        runs = replay_all(rt, traces, specs, on_run=progress.set, on_step=progress.update, clock=clock)
        progress.close()
        progress = None
    except (RuntimeErrorBase, ReplayError) as exc:
        if progress is not None:
            progress.close()
        print(f"session-runtime replay: {type(exc).__name__}: {exc}", file=err)
        return 1
    finally:
        rt.close()
    config = rt.config  # with the template resolved (auto -> deepseek or qwen3)

    setup = (f"model {config.model}{' (its shape only: --no-model)' if args.no_model else ''}, "
             f"template {config.template}, page size {config.page_size}")
    analyses = [analysis.analyze(tr.trace, tr.results, rt.template(tr.results[0].template), cost, clock, price)
                for tr in runs]
    for e in errors:  # --skip-bad
        print(f"skipped (not a trace): {e}", file=out)
    if cost.shape.vocab_size != rt.tokenizer.vocab_size:
        print(f"warning: the token counts come from the {rt.tokenizer.name} tokenizer ({rt.tokenizer.vocab_size} "
              f"ids, template {config.template}) and are priced as {cost.name} ({cost.shape.vocab_size} ids): "
              "its own tokenizer would count the same text differently", file=out)
    print("\n\n".join(describe_trace(tr, setup) + "\n\n" + a.text() for tr, a in zip(runs, analyses)), file=out)
    if len(runs) > 1:
        print("\n" + describe_aggregate(runs), file=out)
        print("\n" + analysis.describe_aggregate(analyses), file=out)
    print("\n" + LEGEND + "\n" + analysis.ECONOMICS_LEGEND, file=out)
    for a in analyses if args.plot else ():
        print(f"wrote {a.plot(args.plot)}", file=out)
    if args.json:
        report = json_report(runs, config, analyses)
        report["skipped"] = list(errors)
        Path(args.json).write_text(json.dumps(report, indent=1))
        print(f"wrote {args.json}", file=out)
    return 0


def json_report(runs, config, analyses=()) -> dict:
    """Every trace's runs (and economics) and the per-policy sums; with one
    trace, its `trace`, `runs` and `economics` at the top level too (the
    one-trace shape of before)."""
    report = {
        "model": config.model, "template": config.template, "page_size": config.page_size,
        "traces": [{"trace": tr.trace.source, "format": tr.trace.format, "notes": list(tr.trace.notes),
                    "runs": [r.as_dict() for r in tr.results]} for tr in runs],
        "aggregate": [a.as_dict() for a in aggregate(runs)],
    }
    for t, a in zip(report["traces"], analyses):
        t["economics"] = a.as_dict()
    if analyses:
        report["aggregate_economics"] = analysis.aggregate_dict(analyses)
    if analyses and len(runs) > 1:
        report["aggregate_verdict"] = analysis.aggregate_verdict(analyses)
    if len(runs) == 1:
        report.update(trace=runs[0].trace.source, runs=report["traces"][0]["runs"])
        if analyses:
            report["economics"] = report["traces"][0]["economics"]
    return report
