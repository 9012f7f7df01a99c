"""Replay a recorded agent trace through the embedded runtime with forced output.

    session-runtime replay examples/sample_trace.jsonl --policy keep --policy drop

The trace is JSONL (examples/TRACE_FORMAT.md): an optional first line
`{"type": "conversation", "system": ..., "tools": [...]}`, then one message a
line: `{"role": "user", "content": ...}`, `{"role": "assistant", "reasoning":
..., "content": ..., "tool_calls": [{"name": ..., "arguments": {...}}]}` and
`{"role": "tool", "content": ...}` (tool results answer the previous
assistant's calls, in order).

Every assistant message is appended as forced output, so each policy sees the
identical conversation and the accounting differs only by what the policy
keeps and reuses. After each turn, pending canonical-branch materializations
run (the idle time between turns) and are counted apart from the prefill on the
request path. Each run gets its own tenant, which salts the cache namespace, so
runs sharing one Runtime never reuse each other's KV.

This module imports SGLang only when it builds a Runtime: parsing and
validating a trace is instant.
"""

from __future__ import annotations

import json
import sys
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable, Optional, Sequence

from session_runtime.policies import MATERIALIZE_MODES, POLICIES

if TYPE_CHECKING:
    from session_runtime.accounting import StepAccounting
    from session_runtime.runtime import Runtime

# Fields a recorded trace may carry that replay does not need (the runtime's own
# trace export has them, so do most loggers).
IGNORED_FIELDS = frozenset({"turn", "step", "created_at", "timestamp", "finish_reason", "id", "tool_call_id"})
ROLES = ("user", "assistant", "tool")


class TraceError(ValueError):
    """A trace that cannot be replayed; `line` is 1-based (0: the trace as a whole)."""

    def __init__(self, line: int, message: str):
        super().__init__(f"line {line}: {message}" if line else message)
        self.line = line
        self.message = message


# ----- the trace ----------------------------------------------------------------


@dataclass(frozen=True)
class TraceStep:
    """One assistant message: forced output, sent with the tool results that
    answer the previous step's calls (none for a turn's first step)."""

    line: int
    reasoning: str
    content: str
    tool_calls: tuple[dict, ...]  # {name, arguments}
    results: tuple[str, ...] = ()

    @property
    def forced(self) -> dict:
        return {"reasoning": self.reasoning, "content": self.content,
                "tool_calls": [dict(c) for c in self.tool_calls]}


@dataclass(frozen=True)
class TraceTurn:
    line: int  # the user message
    user: str
    steps: tuple[TraceStep, ...]


@dataclass(frozen=True)
class Trace:
    system: Optional[str]
    tools: list[dict]
    turns: tuple[TraceTurn, ...]
    source: str = "<trace>"

    @property
    def n_steps(self) -> int:
        return sum(len(t.steps) for t in self.turns)

    @property
    def n_tool_calls(self) -> int:
        return sum(len(s.tool_calls) for t in self.turns for s in t.steps)


def load_trace(path: str | Path) -> Trace:
    """Read and validate a JSONL trace file. Raises TraceError (or OSError)."""
    path = Path(path)
    with path.open(encoding="utf-8") as fh:
        return parse_trace(fh, source=str(path))


def parse_trace(lines: Iterable[str] | str, source: str = "<trace>") -> Trace:
    """Validate a trace given as text or lines. Raises TraceError naming the line."""
    if isinstance(lines, str):
        lines = lines.splitlines()
    parser = _Parser()
    for number, raw in enumerate(lines, start=1):
        if raw.strip():
            parser.feed(number, raw)
    return parser.finish(source)


class _Parser:
    """A state machine over messages:

    start --user--> asked --assistant(no calls)--> closed --user--> asked ...
                     asked --assistant(calls)--> calling --tool*n--> answered --assistant--> ...
    """

    def __init__(self) -> None:
        self.system: Optional[str] = None
        self.tools: list[dict] = []
        self.turns: list[TraceTurn] = []
        self.state = "start"
        self.seen_message = False
        self.user: Optional[tuple[int, str]] = None  # line and text of the open turn's user message
        self.steps: list[TraceStep] = []
        self.calls: tuple[dict, ...] = ()  # the last step's calls
        self.calls_line = 0
        self.results: list[str] = []
        self.results_line = 0

    def feed(self, line: int, raw: str) -> None:
        try:
            obj = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise TraceError(line, f"invalid JSON: {exc.msg} (column {exc.colno})") from None
        if not isinstance(obj, dict):
            raise TraceError(line, f"expected a JSON object, got {type(obj).__name__}")
        if "type" in obj and "role" not in obj:
            return self._header(line, obj)
        role = obj.get("role")
        if role not in ROLES:
            what = "no role" if role is None else f"unknown role {role!r}"
            raise TraceError(line, f"{what}; expected one of {', '.join(ROLES)} "
                                   "(or a first line {\"type\": \"conversation\", ...})")
        self.seen_message = True
        getattr(self, "_" + role)(line, obj)

    # ----- one handler per kind of line ------------------------------------------

    def _header(self, line: int, obj: dict) -> None:
        if obj.get("type") != "conversation":
            raise TraceError(line, f"unknown line type {obj.get('type')!r}; only \"conversation\" is known")
        if self.seen_message or self.state != "start":
            raise TraceError(line, "the conversation line must be the first line of the trace")
        _no_extra(line, obj, {"type", "system", "tools"}, "the conversation line")
        system, tools = obj.get("system"), obj.get("tools") or []
        if system is not None and not isinstance(system, str):
            raise TraceError(line, "system must be a string")
        if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
            raise TraceError(line, "tools must be a list of objects (JSON schemas of functions)")
        self.system, self.tools = system or None, tools
        self.state = "header"

    def _user(self, line: int, obj: dict) -> None:
        _no_extra(line, obj, {"role", "content"}, "a user message")
        content = obj.get("content")
        if not isinstance(content, str) or not content.strip():
            raise TraceError(line, "a user message needs a non-empty string content")
        if self.state == "asked":
            raise TraceError(line, f"user message after the user message of line {self.user[0]}, "
                                   "which has no assistant reply")
        if self.state == "calling":
            raise TraceError(line, f"user message while {len(self.calls) - len(self.results)} tool call(s) "
                                   f"of line {self.calls_line} are unanswered")
        if self.state == "answered":
            raise TraceError(line, f"user message while the tool results ending at line {self.results_line} "
                                   "wait for an assistant reply")
        self._close_turn()
        self.user = (line, content)
        self.state = "asked"

    def _assistant(self, line: int, obj: dict) -> None:
        _no_extra(line, obj, {"role", "reasoning", "reasoning_content", "content", "tool_calls"},
                  "an assistant message")
        if self.state in ("start", "header"):
            raise TraceError(line, "assistant message before any user message")
        if self.state == "closed":
            raise TraceError(line, f"assistant message after the turn closed at line {self.steps[-1].line} "
                                   "(that reply made no tool calls); a user message must come first")
        if self.state == "calling":
            raise TraceError(line, f"assistant message while {len(self.calls) - len(self.results)} tool call(s) "
                                   f"of line {self.calls_line} are unanswered")
        if "reasoning" in obj and "reasoning_content" in obj:
            raise TraceError(line, "give reasoning or reasoning_content, not both")
        reasoning = obj.get("reasoning", obj.get("reasoning_content")) or ""
        content = obj.get("content") or ""
        if not isinstance(reasoning, str) or not isinstance(content, str):
            raise TraceError(line, "reasoning and content must be strings")
        raw_calls = obj.get("tool_calls") or []
        if not isinstance(raw_calls, list):
            raise TraceError(line, "tool_calls must be a list")
        calls = tuple(_tool_call(line, i, c) for i, c in enumerate(raw_calls))
        results = tuple(self.results) if self.state == "answered" else ()
        self.steps.append(TraceStep(line, reasoning, content, calls, results))
        self.results = []
        if calls:
            self.calls, self.calls_line, self.state = calls, line, "calling"
        else:
            self.calls, self.state = (), "closed"

    def _tool(self, line: int, obj: dict) -> None:
        _no_extra(line, obj, {"role", "content", "name"}, "a tool result")
        if self.state != "calling":
            why = ""
            if self.state == "answered":
                why = f": the {len(self.calls)} call(s) of line {self.calls_line} are all answered"
            raise TraceError(line, "tool result without a pending tool call" + why)
        content = obj.get("content", "")
        if not isinstance(content, str):
            raise TraceError(line, "a tool result's content must be a string")
        call = self.calls[len(self.results)]
        name = obj.get("name")
        if name is not None and name != call["name"]:
            raise TraceError(line, f"tool result named {name!r} answers call {len(self.results) + 1} of line "
                                   f"{self.calls_line}, which is {call['name']!r}")
        self.results.append(content)
        self.results_line = line
        if len(self.results) == len(self.calls):
            self.state = "answered"

    # ----- the end ----------------------------------------------------------------

    def _close_turn(self) -> None:
        if self.user is not None:
            self.turns.append(TraceTurn(self.user[0], self.user[1], tuple(self.steps)))
        self.user, self.steps = None, []

    def finish(self, source: str) -> Trace:
        if self.state == "asked":
            raise TraceError(self.user[0], "the trace ends after this user message, with no assistant reply")
        if self.state == "calling":
            raise TraceError(self.calls_line, f"the trace ends with {len(self.calls) - len(self.results)} "
                                              "unanswered tool call(s) of this line")
        if self.state == "answered":
            raise TraceError(self.results_line, "the trace ends with tool results that no assistant reply follows")
        self._close_turn()
        if not self.turns:
            raise TraceError(0, "the trace holds no messages")
        return Trace(self.system, self.tools, tuple(self.turns), source)


def _no_extra(line: int, obj: dict, allowed: set[str], what: str) -> None:
    extra = sorted(set(obj) - allowed - IGNORED_FIELDS)
    if extra:
        raise TraceError(line, f"unknown field(s) {', '.join(map(repr, extra))} in {what}; "
                               f"known: {', '.join(sorted(allowed))}")


def _tool_call(line: int, index: int, call: object) -> dict:
    """{name, arguments} from {name, arguments} or OpenAI's {type, function: {...}}."""
    where = f"tool_calls[{index}]"
    if not isinstance(call, dict):
        raise TraceError(line, f"{where} must be an object")
    fn = call.get("function", call) if isinstance(call.get("function"), dict) else call
    name, args = fn.get("name"), fn.get("arguments", {})
    if not isinstance(name, str) or not name:
        raise TraceError(line, f"{where} needs a non-empty string name")
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            raise TraceError(line, f"{where}.arguments is a string but not JSON") from None
    if not isinstance(args, dict):
        raise TraceError(line, f"{where}.arguments must be an object")
    return {"name": name, "arguments": args}


# ----- running it -----------------------------------------------------------------


@dataclass(frozen=True)
class RunSpec:
    """One replay: a policy, its materialization mode and a label for tables."""

    policy: str
    materialize: str = "auto"
    keep_last_k: int = 1
    label: str = ""

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"unknown policy {self.policy!r}; one of {', '.join(POLICIES)}")
        if self.materialize not in MATERIALIZE_MODES:
            raise ValueError(f"unknown materialize mode {self.materialize!r}; one of {', '.join(MATERIALIZE_MODES)}")
        if not self.label:
            object.__setattr__(self, "label", self.default_label())

    def default_label(self) -> str:
        name = f"keep_last_{self.keep_last_k}" if self.policy == "keep_last_k" else self.policy
        return f"{name}:{self.materialize}" if self.policy in ("drop", "keep_last_k") else name


def parse_run_spec(text: str, materialize: str = "auto", keep_last_k: int = 1) -> RunSpec:
    """`POLICY[:MATERIALIZE]`, e.g. `keep`, `drop:never`, `keep_last_k:always`."""
    name, _, mode = text.partition(":")
    return RunSpec(name, mode or materialize, keep_last_k)


# drop under both extremes: auto decides per turn (|R| against the tail it would prefill) and
# often skips tool-heavy turns, so `--policy drop` adds it when wanted.
COMPARE = ("keep", "drop:never", "drop:always", "keep_last_k", "engine_default", "strip_thinking_cache")


@dataclass
class TurnResult:
    index: int
    line: int
    steps: list["StepAccounting"]
    materialized: int = 0  # idle-time prefill of the canonical branch after the turn closed
    fork_tokens: Optional[int] = None
    materialize_decision: Optional[str] = None

    @property
    def first(self) -> "StepAccounting":
        return self.steps[0]

    @property
    def tool_step_prefill(self) -> int:
        return sum(s.uncached_prefill_tokens for s in self.steps[1:])

    def row(self) -> dict:
        f, cf = self.first, self.first.counterfactual or {}
        return {
            "turn": self.index + 1, "line": self.line, "steps": len(self.steps),
            "prompt": f.prompt_tokens, "cached": f.cached_input_tokens, "prefill": f.uncached_prefill_tokens,
            "state": f.cache_state,
            "cf_keep": cf.get("keep", {}).get("prefill_tokens"), "cf_drop": cf.get("drop", {}).get("prefill_tokens"),
            "tool_prefill": self.tool_step_prefill,
            "recomputed": sum(s.recomputed_history_tokens for s in self.steps),
            "materialized": self.materialized,
            "context": self.steps[-1].active_context_length,
        }

    def as_dict(self) -> dict:
        return {**self.row(), "fork_tokens": self.fork_tokens, "materialize_decision": self.materialize_decision,
                "step_accounting": [s.as_dict() for s in self.steps]}


@dataclass
class ReplayResult:
    spec: RunSpec
    conversation_id: str
    tenant: str
    turns: list[TurnResult] = field(default_factory=list)

    @property
    def all_steps(self) -> list["StepAccounting"]:
        return [s for t in self.turns for s in t.steps]

    def totals(self) -> dict:
        steps = self.all_steps
        s = lambda key: sum(getattr(a, key) for a in steps)  # noqa: E731
        rows = [t.row() for t in self.turns]
        prefill, materialized = s("uncached_prefill_tokens"), sum(t.materialized for t in self.turns)
        return {
            "steps": len(steps),
            "prompt": s("prompt_tokens"),
            "cached": s("cached_input_tokens"),
            "prefill": prefill,
            "turn_start_prefill": sum(r["prefill"] for r in rows),
            "tool_prefill": sum(r["tool_prefill"] for r in rows),
            "recomputed": s("recomputed_history_tokens"),
            "materialized": materialized,
            "compute": prefill + materialized,
            "output": s("output_tokens"),
            "context": self.turns[-1].steps[-1].active_context_length if self.turns else 0,
            "cf_keep": sum(r["cf_keep"] or 0 for r in rows),
            "cf_drop": sum(r["cf_drop"] or 0 for r in rows),
            "attention_work": s("attention_work"),
        }

    def as_dict(self) -> dict:
        return {"label": self.spec.label, "policy": self.spec.policy, "materialize": self.spec.materialize,
                "keep_last_k": self.spec.keep_last_k, "conversation_id": self.conversation_id,
                "tenant": self.tenant, "totals": self.totals(), "turns": [t.as_dict() for t in self.turns]}


class ReplayError(RuntimeError):
    """The runtime disagreed with the trace (e.g. a forced tool call did not parse back)."""


def replay(
    rt: "Runtime",
    trace: Trace,
    spec: RunSpec | str = "drop",
    *,
    tenant: Optional[str] = None,
    on_step: Optional[Callable[[], None]] = None,
    delete: bool = True,
) -> ReplayResult:
    """Play `trace` in a new conversation of `rt` with forced output.

    Pending materializations run after each turn closes (the idle time between
    turns) and count as that turn's `materialized` tokens. `tenant` defaults to
    a fresh one, so the run shares no KV with earlier runs in the same Runtime.
    The conversation is deleted at the end unless `delete` is False (its KV stays
    in the tree, evictable).
    """
    if isinstance(spec, str):
        spec = parse_run_spec(spec)
    tenant = tenant or f"replay-{spec.label}-{uuid.uuid4().hex[:8]}"
    cid = rt.create_conversation(trace.system, tools=trace.tools, tenant=tenant, policy=spec.policy,
                                 keep_last_k=spec.keep_last_k, materialize=spec.materialize)
    result = ReplayResult(spec, cid, tenant)
    try:
        for index, turn in enumerate(trace.turns):
            steps = []
            prev = None
            for k, ts in enumerate(turn.steps):
                if k == 0:
                    step = rt.send_message(cid, turn.user, forced=ts.forced)
                else:
                    ids = [c["id"] for c in prev.tool_calls]
                    step = rt.send_tool_results(
                        cid, [{"tool_call_id": i, "content": r} for i, r in zip(ids, ts.results)], forced=ts.forced)
                if len(step.tool_calls) != len(ts.tool_calls):
                    raise ReplayError(f"line {ts.line}: {len(ts.tool_calls)} forced tool call(s) parsed back as "
                                      f"{len(step.tool_calls)} by the {rt.get(cid).template} template")
                steps.append(step.accounting)
                prev = step
                if on_step is not None:
                    on_step()
            before = rt.materializer.stats["prefill_tokens"]
            rt.materializer.run_pending()
            rt.materializer.wait_idle()
            record = rt.describe(cid)["turns"][index]
            result.turns.append(TurnResult(index, turn.line, steps, rt.materializer.stats["prefill_tokens"] - before,
                                           record["fork_tokens"], record["materialize"]))
    finally:
        if delete:
            rt.delete_conversation(cid)
    return result


# ----- tables -------------------------------------------------------------------------

TURN_COLUMNS = (
    ("turn", "turn"), ("line", "line"), ("steps", "steps"), ("prompt", "prompt"), ("cached", "cached"),
    ("prefill", "prefill"), ("state", "cache_state"), ("cf_keep", "cf_keep"), ("cf_drop", "cf_drop"),
    ("tool_prefill", "tool_prefill"), ("recomputed", "recomputed"), ("materialized", "materialized"),
    ("context", "context"),
)
TOTAL_COLUMNS = (
    ("label", "policy"), ("steps", "steps"), ("prompt", "prompt"), ("cached", "cached"),
    ("hit", "hit%"), ("turn_start_prefill", "turn_start"), ("tool_prefill", "tool_steps"),
    ("prefill", "prefill"), ("recomputed", "recomputed"), ("materialized", "materialized"),
    ("compute", "compute"), ("context", "context"),
)
LEGEND = """\
Per turn: prompt, cached, prefill and cache_state are the turn's first step (the user message);
cf_keep / cf_drop: what that step would prefill if every turn's reasoning were kept / if closed
turns' reasoning were dropped, probed on this run's tree just before the step; tool_prefill: the
prefill of the turn's later steps (tool results); recomputed: prefill spent on tokens before each
step's new input; materialized: idle-time prefill of the canonical branch after the turn closed
(off the request path); context: tokens the next turn starts from.
Totals table: prompt, cached and prefill sum every step (tool steps included); turn_start and
tool_steps split prefill; compute = prefill + materialized; hit% = cached / prompt."""


def format_table(headers: Sequence[str], rows: Sequence[Sequence[object]],
                 footer: Sequence[Sequence[object]] = ()) -> str:
    """Fixed-width columns: numbers right-aligned, text left-aligned; `footer`
    rows (totals) sit below a second rule."""
    every = [*rows, *footer]
    cells = [[("-" if v is None else str(v)) for v in row] for row in every]
    widths = [max([len(h), *(len(r[i]) for r in cells)]) for i, h in enumerate(headers)]
    numeric = [all(isinstance(row[i], (int, float)) or row[i] is None for row in rows) for i in range(len(headers))]

    def line(values: Sequence[str]) -> str:
        return "  ".join(v.rjust(widths[i]) if numeric[i] else v.ljust(widths[i])
                         for i, v in enumerate(values)).rstrip()

    rule = "  ".join("-" * w for w in widths)
    out = [line(list(headers)), rule, *(line(r) for r in cells[: len(rows)])]
    if footer:
        out += [rule, *(line(r) for r in cells[len(rows):])]
    return "\n".join(out)


def turn_table(result: ReplayResult) -> str:
    """One row per turn; the footer sums each column (context: the final one)."""
    rows = [t.row() for t in result.turns]
    total = {k: sum(r[k] or 0 for r in rows) for k, _ in TURN_COLUMNS if k not in ("turn", "line", "state")}
    total.update(turn="total", line=None, state="", context=rows[-1]["context"] if rows else 0)
    return format_table([h for _, h in TURN_COLUMNS], [[r[k] for k, _ in TURN_COLUMNS] for r in rows],
                        [[total[k] for k, _ in TURN_COLUMNS]])


def totals_table(results: Sequence[ReplayResult]) -> str:
    rows = []
    for r in results:
        t = {**r.totals(), "label": r.spec.label}
        t["hit"] = round(100 * t["cached"] / t["prompt"], 1) if t["prompt"] else 0.0
        rows.append([t[k] for k, _ in TOTAL_COLUMNS])
    return format_table([h for _, h in TOTAL_COLUMNS], rows)


def describe_run(result: ReplayResult) -> str:
    s, t = result.spec, result.totals()
    head = f"== {s.label}: policy={s.policy}"
    if s.policy == "keep_last_k":
        head += f" k={s.keep_last_k}"
    if s.policy in ("drop", "keep_last_k"):
        head += f" materialize={s.materialize}"
    return "\n".join([
        head + " ==",
        turn_table(result),
        f"request-path prefill {t['prefill']} (turn starts {t['turn_start_prefill']} + tool steps {t['tool_prefill']})"
        f", idle-time materialization {t['materialized']}, compute {t['compute']}; cached {t['cached']} of "
        f"{t['prompt']} prompt tokens; {t['output']} output tokens; final context {t['context']}",
    ])


# ----- progress ------------------------------------------------------------------------


class Progress:
    """tqdm on stderr when installed, else a plain `[#####.....] n/N` bar."""

    def __init__(self, total: int, enabled: bool = True, stream=None):
        self.total, self.n, self.enabled = total, 0, enabled
        self.stream = stream or sys.stderr
        self.desc = ""
        self._bar = None
        if enabled:
            try:
                from tqdm import tqdm
            except ImportError:
                tqdm = None
            if tqdm is not None:
                self._bar = tqdm(total=total, unit="step", file=self.stream, leave=True, dynamic_ncols=True)

    def set(self, desc: str) -> None:
        self.desc = desc
        if self._bar is not None:
            self._bar.set_description(desc)

    def update(self) -> None:
        self.n += 1
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.update(1)
            return
        width = 30
        done = width * self.n // max(self.total, 1)
        self.stream.write(f"\r{self.desc:<24} [{'#' * done}{'.' * (width - done)}] {self.n}/{self.total}")
        self.stream.flush()

    def close(self) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.close()
        else:
            self.stream.write("\n")
            self.stream.flush()


# ----- the CLI command ---------------------------------------------------------------------


def add_arguments(parser) -> None:
    """The `replay` subcommand's flags (cli.py builds the subparser)."""
    from session_runtime.config import PRESETS, RuntimeConfig

    d = RuntimeConfig()
    parser.add_argument("trace", help="JSONL trace (see examples/TRACE_FORMAT.md)")
    parser.add_argument("--policy", action="append", default=None, metavar="POLICY[:MATERIALIZE]",
                        help=f"policy to replay under; repeat to compare ({', '.join(POLICIES)}); "
                             "a suffix such as drop:never sets that run's materialize mode (default: drop)")
    parser.add_argument("--compare", action="store_true",
                        help=f"replay under {', '.join(COMPARE)} (after any --policy)")
    parser.add_argument("--keep-last-k", type=int, default=1, help="k of keep_last_k")
    parser.add_argument("--materialize", default="auto", choices=MATERIALIZE_MODES,
                        help="materialize mode of runs that do not set one")
    parser.add_argument("--model", default=d.model, help=f"a preset ({', '.join(PRESETS)}) or a local HF folder")
    parser.add_argument("--template", default=d.template, choices=["deepseek", "qwen3"])
    parser.add_argument("--device", default=d.device)
    parser.add_argument("--dtype", default=d.dtype)
    parser.add_argument("--page-size", type=int, default=d.page_size)
    parser.add_argument("--pool-tokens", type=int, default=d.pool_tokens)
    parser.add_argument("--max-context", type=int, default=d.max_context)
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument("--json", metavar="PATH", help="also write every run's per-step accounting as JSON")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


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
    """`session-runtime replay`: validate the trace, then build the Runtime (slow)."""
    out, err = out or sys.stdout, err or sys.stderr
    if args.keep_last_k < 0:
        print("session-runtime replay: --keep-last-k must be >= 0", file=err)
        return 2
    try:
        specs = run_specs(args)
        trace = load_trace(args.trace)
    except TraceError as exc:
        print(f"session-runtime replay: {args.trace}: {exc}", file=err)
        return 2
    except (OSError, ValueError) as exc:
        print(f"session-runtime replay: {exc}", file=err)
        return 2

    from session_runtime.config import RuntimeConfig
    from session_runtime.errors import RuntimeErrorBase

    try:
        config = RuntimeConfig(model=args.model, device=args.device, dtype=args.dtype, page_size=args.page_size,
                               pool_tokens=args.pool_tokens, max_context=args.max_context, seed=args.seed,
                               template=args.template)
    except ValueError as exc:
        print(f"session-runtime replay: {exc}", file=err)
        return 2
    print(f"session-runtime replay: {trace.source}: {len(trace.turns)} turns, {trace.n_steps} steps, "
          f"{trace.n_tool_calls} tool calls; loading {config.model} ...", file=err, flush=True)
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
        progress = Progress(trace.n_steps * len(specs), enabled=not args.no_progress, stream=err)
        results = []
        for spec in specs:
            progress.set(spec.label)
            results.append(replay(rt, trace, spec, on_step=progress.update))
        progress.close()
        progress = None
    except (RuntimeErrorBase, ReplayError) as exc:
        if progress is not None:
            progress.close()
        print(f"session-runtime replay: {type(exc).__name__}: {exc}", file=err)
        return 1
    finally:
        rt.close()

    print(f"trace {trace.source}: {len(trace.turns)} turns, {trace.n_steps} steps, {trace.n_tool_calls} tool "
          f"calls; model {config.model}, template {config.template}, page size {config.page_size}", file=out)
    for r in results:
        print("", file=out)
        print(describe_run(r), file=out)
    if len(results) > 1:
        print("\n== totals ==", file=out)
        print(totals_table(results), file=out)
    print("\n" + LEGEND, file=out)
    if args.json:
        Path(args.json).write_text(json.dumps({
            "trace": trace.source, "model": config.model, "template": config.template,
            "page_size": config.page_size, "runs": [r.as_dict() for r in results],
        }, indent=1))
        print(f"wrote {args.json}", file=out)
    return 0
