"""Clearing old tool uses from the prompt (Anthropic's context edit
`clear_tool_uses_20250919`, ../shared/HARNESSES.md).

The client keeps its whole history and sends it every time; the server decides,
request by request, which tool uses the prompt shows cleared:

- **trigger**: nothing is cleared until the request's input (its prompt tokens
  with the request's thinking edit applied first; `{type: input_tokens}`, the
  default 100,000) or its count of tool uses (`{type: tool_uses}`) exceeds the
  value;
- **candidates**: every tool use but the last `keep` (`{type: tool_uses}`,
  default 3), those of `exclude_tools`, and those whose results are this
  request's own new input (the open step's results are never cleared, as the
  open turn's thinking never is), oldest first;
- **clear_at_least** (`{type: input_tokens}`): the oldest candidates are
  cleared until that many tokens are, and nothing when all of them together
  would not reach it; without it every candidate is cleared;
- a cleared use's result is replaced by PLACEHOLDER; with `clear_tool_inputs`
  (true, or a list of tool names) its call's arguments become `{}` as well.

The stored conversation keeps every result as the client sent it (its trace:
the client's next request carries them again); only the canonical history the
prompt renders from shows them cleared (`apply`). The prompt therefore forks
at the first newly cleared block, as it does where a closed turn drops its
reasoning, and the tokens past the fork are prefilled under their own
`uncached` reason, `tool_uses_cleared`.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from session_runtime.errors import InvalidRequest
from session_runtime.templates.base import Message, Template

CLEAR_TOOL_USES = "clear_tool_uses_20250919"
PLACEHOLDER = "[tool result cleared by context management]"
_DEFAULT_TRIGGER = ("input_tokens", 100_000)
_DEFAULT_KEEP = 3


@dataclass(frozen=True)
class Cleared:
    """Which tool uses a prompt shows cleared, by call id: their results, and of those, their inputs."""

    results: frozenset = frozenset()
    inputs: frozenset = frozenset()

    def __bool__(self) -> bool:
        return bool(self.results)

    def as_dict(self) -> dict:
        return {"results": sorted(self.results), "inputs": sorted(self.inputs)}


NOTHING = Cleared()


@dataclass(frozen=True)
class ToolUseEdit:
    """`clear_tool_uses_20250919` as a request states it (defaults filled in)."""

    trigger: tuple[str, int] = _DEFAULT_TRIGGER  # (input_tokens | tool_uses, value)
    keep: int = _DEFAULT_KEEP
    clear_at_least: Optional[int] = None
    exclude_tools: frozenset = frozenset()
    clear_inputs: object = False  # True, False, or a frozenset of tool names

    @property
    def needs_input_tokens(self) -> bool:
        return self.trigger[0] == "input_tokens"

    def clears_input_of(self, name: str) -> bool:
        return self.clear_inputs is True or (isinstance(self.clear_inputs, frozenset) and name in self.clear_inputs)


@dataclass(frozen=True)
class ToolUse:
    """One tool use of a request, in order: its call and its result's text (None: no result yet)."""

    call_id: str
    name: str
    arguments: str  # as JSON text
    result: Optional[str]


def parse(edit: dict, where: str) -> ToolUseEdit:
    """The edit's settings. Raises InvalidRequest naming the field."""
    unknown = set(edit) - {"type", "trigger", "keep", "clear_at_least", "exclude_tools", "clear_tool_inputs"}
    if unknown:
        name = sorted(unknown)[0]
        raise InvalidRequest(f"{where}.{name}: Extra inputs are not permitted", param=f"{where}.{name}")
    trigger = _DEFAULT_TRIGGER
    if edit.get("trigger") is not None:
        trigger = _amount(edit["trigger"], ("input_tokens", "tool_uses"), f"{where}.trigger")
    keep = _DEFAULT_KEEP if edit.get("keep") is None else _amount(edit["keep"], ("tool_uses",), f"{where}.keep")[1]
    at_least = None if edit.get("clear_at_least") is None else \
        _amount(edit["clear_at_least"], ("input_tokens",), f"{where}.clear_at_least")[1]
    exclude = edit.get("exclude_tools") or []
    if not isinstance(exclude, list) or not all(isinstance(n, str) for n in exclude):
        raise InvalidRequest(f"{where}.exclude_tools: expected a list of tool names", param=f"{where}.exclude_tools")
    inputs = edit.get("clear_tool_inputs", False)
    if inputs is None:
        inputs = False
    if isinstance(inputs, list) and all(isinstance(n, str) for n in inputs):
        inputs = frozenset(inputs)
    elif not isinstance(inputs, bool):
        raise InvalidRequest(f"{where}.clear_tool_inputs: expected a boolean or a list of tool names",
                             param=f"{where}.clear_tool_inputs")
    return ToolUseEdit(trigger, keep, at_least, frozenset(exclude), inputs)


def tool_uses(messages: Sequence[dict]) -> list[ToolUse]:
    """The tool uses of chat `messages` (OpenAI's shape, as the protocol routes
    convert to), in the order they were called."""
    results = {str(m.get("tool_call_id")): m.get("content") for m in messages
               if isinstance(m, dict) and m.get("role") == "tool"}
    out = []
    for m in messages:
        if not isinstance(m, dict) or m.get("role") != "assistant":
            continue
        for call in m.get("tool_calls") or ():
            fn = call.get("function") or {}
            result = results.get(str(call.get("id")))
            out.append(ToolUse(str(call.get("id")), str(fn.get("name", "")), str(fn.get("arguments", "{}")),
                               result if isinstance(result, str) or result is None else json.dumps(result)))
    return out


def decide(edit: ToolUseEdit, uses: Sequence[ToolUse], new_results: frozenset, input_tokens: Optional[int],
           count: Callable[[str], int]) -> Cleared:
    """The tool uses `edit` clears from a request with these `uses`, whose new
    input answers the calls `new_results`, and whose prompt is `input_tokens`
    long (read only for an input_tokens trigger); `count`: tokens of a text."""
    kind, value = edit.trigger
    measure = input_tokens if kind == "input_tokens" else len(uses)
    if measure is None or measure <= value:
        return NOTHING
    kept = uses[len(uses) - edit.keep:] if edit.keep else ()
    kept_ids = {u.call_id for u in kept}
    candidates = [u for u in uses if u.call_id not in kept_ids and u.call_id not in new_results
                  and u.name not in edit.exclude_tools and u.result is not None]
    chosen, freed = [], 0
    for use in candidates:
        if edit.clear_at_least is not None and freed >= edit.clear_at_least:
            break
        chosen.append(use)
        if edit.clear_at_least is not None:
            freed += count(use.result) - count(PLACEHOLDER)
            if edit.clears_input_of(use.name):
                freed += count(use.arguments) - count("{}")
    if not chosen or (edit.clear_at_least is not None and freed < edit.clear_at_least):
        return NOTHING
    return Cleared(frozenset(u.call_id for u in chosen),
                   frozenset(u.call_id for u in chosen if edit.clears_input_of(u.name)))


def apply(tpl: Template, messages: Sequence[Message], cleared: Cleared) -> list[Message]:
    """`messages` (runtime messages) as the prompt shows them with `cleared`:
    cleared results say PLACEHOLDER, cleared calls have `{}` for arguments
    (their assistant message's ids rewritten as the template writes it)."""
    if not cleared:
        return list(messages)
    out = []
    for m in messages:
        if m.role == "tool" and m.tool_call_id in cleared.results:
            m = dataclasses.replace(m, content=PLACEHOLDER)
        elif m.role == "assistant" and any(c.id in cleared.inputs for c in m.tool_calls):
            calls = tuple(dataclasses.replace(c, arguments={}) if c.id in cleared.inputs else c
                          for c in m.tool_calls)
            m = dataclasses.replace(m, tool_calls=calls,
                                    output_ids=tuple(tpl.forced_ids(m.reasoning, m.content, list(calls))))
        out.append(m)
    return out


def _amount(raw: object, kinds: tuple[str, ...], where: str) -> tuple[str, int]:
    if isinstance(raw, dict) and raw.get("type") in kinds:
        value = raw.get("value")
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return raw["type"], value
        raise InvalidRequest(f"{where}.value: expected an integer >= 0", param=f"{where}.value")
    shapes = " or ".join(f'{{"type": "{k}", "value": N}}' for k in kinds)
    raise InvalidRequest(f"{where}: expected {shapes}", param=where)
