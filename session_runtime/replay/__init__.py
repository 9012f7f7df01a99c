"""Replay a recorded agent trace through the embedded runtime with forced output.

    session-runtime replay examples/sample_trace.jsonl --policy keep --policy drop
    session-runtime replay examples/traces 'jobs/**/trajectory.json' --compare

A trace is our JSONL (an optional first line `{"type": "conversation",
"system": ..., "tools": [...]}`, then one message a line), a Harbor ATIF
trajectory, OpenAI chat messages or Anthropic messages (formats/, detected per
file; examples/TRACE_FORMAT.md). Every reader goes through one state machine
(builder.py): tool results are matched to their calls by id, a leading
greeting is folded into the system prompt and a trailing unanswered user
message skipped, with notes. Many traces replay in one Runtime, and each
policy's totals are summed over them (batch.py).

Every assistant message is appended as forced output, so each policy sees the
identical conversation and the accounting differs only by what the policy
keeps and reuses. After each turn, pending canonical-branch materializations
run (the idle time between turns) and are counted apart from the prefill on the
request path. Each run gets its own tenant, which salts the cache namespace, so
runs sharing one Runtime never reuse each other's KV.

This module imports SGLang only when it builds a Runtime: parsing and
validating a trace is instant.

May import the runtime (to replay through it), the cost model and the core;
nothing imports it but the CLI.
"""


from session_runtime.replay.command import add_arguments, run_command
from session_runtime.replay.report import Progress, describe_run, format_table, totals_table, turn_table
from session_runtime.replay.run import ReplayError, ReplayResult, RunSpec, TurnResult, parse_run_spec, replay
from session_runtime.replay.formats.jsonl import load_trace, parse_trace
from session_runtime.replay.trace import Trace, TraceError, TraceStep, TraceTurn
from session_runtime.replay.formats import FORMATS, collect_paths, detect
from session_runtime.replay.formats import load as load_any

__all__ = [
    "add_arguments", "run_command", "Progress", "describe_run", "format_table", "totals_table", "turn_table",
    "ReplayError", "ReplayResult", "RunSpec", "TurnResult", "parse_run_spec", "replay",
    "Trace", "TraceError", "TraceStep", "TraceTurn", "load_trace", "parse_trace",
    "FORMATS", "collect_paths", "detect", "load_any",
]
