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


from session_runtime.replay.command import add_arguments, run_command
from session_runtime.replay.report import Progress, describe_run, format_table, totals_table, turn_table
from session_runtime.replay.run import ReplayError, ReplayResult, RunSpec, TurnResult, parse_run_spec, replay
from session_runtime.replay.trace import Trace, TraceError, TraceStep, TraceTurn, load_trace, parse_trace

__all__ = [
    "add_arguments", "run_command", "Progress", "describe_run", "format_table", "totals_table", "turn_table",
    "ReplayError", "ReplayResult", "RunSpec", "TurnResult", "parse_run_spec", "replay",
    "Trace", "TraceError", "TraceStep", "TraceTurn", "load_trace", "parse_trace",
]
