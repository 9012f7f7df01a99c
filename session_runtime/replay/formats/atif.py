"""Harbor's Agent Trajectory Interchange Format (ATIF, `trajectory.json`) as a trace.

Schema source: the ATIF RFC, harbor `docs/rfcs/0001-trajectory-format.md`
(github.com/laude-institute/harbor, now harbor-framework/harbor; read as the
v1.4 text mirrored in OpenAgentsInc/openagents `docs/atif/0001-trajectory-format.md`)
and harborframework.com/docs/trajectory-format; v1.5's `agent.tool_definitions`
(OpenAI function schemas) as in microsoft/vscode-copilot-chat
`src/platform/trajectory/common/trajectoryTypes.ts`; v1.6's content parts as in
harbor's `ObservationResult` model (`content: str | list[ContentPart]`).

    {"schema_version": "ATIF-v1.6", "session_id": ..., "agent": {"name", "version",
     "model_name"?, "tool_definitions"?}, "steps": [StepObject ...], "notes"?,
     "final_metrics"?, "extra"?}
    StepObject: {"step_id": 1, "timestamp"?, "source": "system" | "user" | "agent",
     "message": str | [ContentPart], "reasoning_content"?, "tool_calls"?:
     [{"tool_call_id", "function_name", "arguments": {...}}], "observation"?:
     {"results": [{"source_call_id"?, "content"?, "subagent_trajectory_ref"?}]},
     "metrics"?, "model_name"?, "extra"?}

An agent step is one model output: `reasoning_content` is its reasoning,
`message` its text, `tool_calls` its calls, and its `observation.results` the
tool results, matched to the calls by `source_call_id` (a result without one
takes the next unanswered call, in order). Those results are sent with the
next agent step. System steps before the first user step are the system
prompt. Metrics, timestamps, model names and `extra` are not needed to replay
and are ignored, as are fields of later ATIF versions. Records are named
`steps[i] (step_id N)`.
"""

from __future__ import annotations

from session_runtime.replay.builder import Call, TraceBuilder, Where
from session_runtime.replay.formats.common import Dropped, json_arguments, load_json, string, string_id, text_of
from session_runtime.replay.trace import Trace, TraceError

SOURCES = ("system", "user", "agent")


def looks_like(data: object) -> bool:
    return isinstance(data, dict) and isinstance(data.get("steps"), list) and (
        str(data.get("schema_version", "")).startswith("ATIF") or "agent" in data)


def read(text: str, source: str) -> Trace:
    """Raises TraceError naming the step and field."""
    data = load_json(text)
    if not isinstance(data, dict) or not isinstance(data.get("steps"), list):
        raise TraceError(0, "an ATIF trajectory is an object with a list `steps`")
    version = data.get("schema_version")
    if not isinstance(version, str) or not version.startswith("ATIF-v1"):
        raise TraceError(0, f"expected \"ATIF-v1.x\", got {version!r}", field="schema_version")
    agent = data.get("agent") or {}
    tools = (agent.get("tool_definitions") or []) if isinstance(agent, dict) else []
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise TraceError(0, "must be a list of function schemas", field="agent.tool_definitions")
    builder, dropped = TraceBuilder(None, tools), Dropped()
    for i, step in enumerate(data["steps"]):
        _step(builder, dropped, i, step)
    if data.get("continued_trajectory_ref"):
        builder.note(None, f"the trajectory continues in {data['continued_trajectory_ref']!r}, which is not read")
    for note in dropped.notes():
        builder.note(None, note)
    return builder.finish(source, "atif")


def _step(builder: TraceBuilder, dropped: Dropped, i: int, step: object) -> None:
    if not isinstance(step, dict):
        raise TraceError(i + 1, f"a step must be an object, got {type(step).__name__}", f"steps[{i}]")
    step_id = step.get("step_id")
    where = Where(i + 1, f"steps[{i}]" + (f" (step_id {step_id})" if isinstance(step_id, int) else ""), "step",
                  step.get("timestamp") if isinstance(step, dict) else None)
    if not isinstance(step_id, int) or isinstance(step_id, bool):
        raise where.error("needs an integer step_id", "step_id")
    kind = step.get("source")
    if kind not in SOURCES:
        raise where.error(f"{'no source' if kind is None else f'unknown source {kind!r}'}; "
                          f"expected one of {', '.join(SOURCES)}", "source")
    message = text_of(where, "message", step.get("message"), dropped, "\n\n")
    observation = step.get("observation")
    if kind == "system":
        builder.system(where, message)
        if observation:
            builder.note(where, "a system step's observation is not replayed")
    elif kind == "user":
        builder.user(where, message)
    else:
        reasoning = string(where, "reasoning_content", step.get("reasoning_content"))
        builder.assistant(where, reasoning, message, _calls(where, step.get("tool_calls")))
        if observation is not None:
            _results(builder, dropped, where, observation)


def _calls(where: Where, raw: object) -> list[Call]:
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise where.error("must be a list", "tool_calls")
    calls = []
    for j, c in enumerate(raw):
        field = f"tool_calls[{j}]"
        if not isinstance(c, dict):
            raise where.error("must be an object", field)
        name = c.get("function_name")
        if not isinstance(name, str) or not name:
            raise where.error("needs a non-empty string", f"{field}.function_name")
        call_id = string_id(c.get("tool_call_id"))
        if call_id is None:
            raise where.error("needs a non-empty string (results refer to it)", f"{field}.tool_call_id")
        calls.append(Call(name, json_arguments(where, f"{field}.arguments", c.get("arguments")), call_id))
    return calls


def _results(builder: TraceBuilder, dropped: Dropped, where: Where, observation: object) -> None:
    results = observation.get("results") if isinstance(observation, dict) else None
    if not isinstance(results, list):
        raise where.error("must be {results: [...]}", "observation")
    for j, r in enumerate(results):
        field = f"observation.results[{j}]"
        if not isinstance(r, dict):
            raise where.error("must be an object", field)
        if r.get("subagent_trajectory_ref"):
            builder.note(where, f"{field} refers to a subagent trajectory, which is not replayed "
                                "(its content, if any, is the result)")
        content = text_of(where, f"{field}.content", r.get("content"), dropped, "\n\n")
        call_id = r.get("source_call_id")
        if call_id is not None and not isinstance(call_id, str):
            raise where.error("must be a string or null", f"{field}.source_call_id")
        builder.tool(where, content, call_id or None, None, f"{field}.source_call_id")
