"""The seed's DeepSeek wire shapes (PROTOCOLS.md section 6) as request bodies,
with what the live API answered and what our stripper makes of them.

V0-V4 (reasoning-passthrough-probe): sys -> user -> asst#1 (content null,
reasoning, a calc call) -> tool -> asst#2 (the same) -> tool -> user.
W1-W6 (reasoning-guard-probe): a fully stripped history with a long draft
assistant at the end, alone, under a system nudge, or as a tool-call turn.

Each `SHAPES[name]()` builds a fresh body. `EXPECTED[name]` gives the status
for the raw body and for the body after `strip()` with default options, with
passthrough, and with the nudge rewrite off. Shared with the proxy's
HTTP-level tests: keep the names and statuses stable.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

MODEL = "deepseek-v4-flash"
NUDGE = "⟦DSC:EARLY_FINAL⟧ Check yourself: is the task really done? If not, keep working."
DRAFT = "Here is the report so far. " * 40
TOOLS = [{"type": "function", "function": {
    "name": "calc", "description": "Evaluate an arithmetic expression.",
    "parameters": {"type": "object", "properties": {"expr": {"type": "string"}}, "required": ["expr"]}}}]


def _body(messages: list[dict]) -> dict:
    return {"model": MODEL, "messages": messages, "tools": TOOLS, "thinking": {"type": "enabled"},
            "reasoning_effort": "high"}


def _call_turn(n: int, expr: str, reasoning: bool = True, content=None) -> dict:
    msg = {"role": "assistant", "content": content}
    if reasoning:
        msg["reasoning_content"] = f"Step {n}: I should call calc with {expr}."
    msg["tool_calls"] = [{"id": f"call_{n}", "type": "function",
                          "function": {"name": "calc", "arguments": f'{{"expr": "{expr}"}}'}}]
    return msg


def _tool(n: int, result: str) -> dict:
    return {"role": "tool", "tool_call_id": f"call_{n}", "content": result}


def _v(strip_first: bool, strip_second: bool, content) -> dict:
    return _body([
        {"role": "system", "content": "You are a careful assistant. Use calc for arithmetic."},
        {"role": "user", "content": "What is (2+2)*3?"},
        _call_turn(1, "2+2", reasoning=not strip_first, content=content), _tool(1, "4"),
        _call_turn(2, "4*3", reasoning=not strip_second, content=content), _tool(2, "12"),
        {"role": "user", "content": "Thanks. And what was the intermediate result?"},
    ])


def _history(reasoning: bool) -> list[dict]:
    answer = {"role": "assistant", "content": "2+2 = 4."}
    if reasoning:
        answer["reasoning_content"] = "The tool said 4; answer briefly."
    return [{"role": "system", "content": "You are a careful assistant."},
            {"role": "user", "content": "Compute 2+2."},
            _call_turn(1, "2+2", reasoning=reasoning), _tool(1, "4"), answer,
            {"role": "user", "content": "Now write the long report."}]


def _draft(reasoning: bool) -> dict:
    msg = {"role": "assistant", "content": DRAFT}
    if reasoning:
        msg["reasoning_content"] = "Drafting the report section by section."
    return msg


def _nudge() -> dict:
    return {"role": "system", "content": NUDGE}


SHAPES: dict[str, Callable[[], dict]] = {
    "V0": lambda: _v(False, False, None),
    "V1": lambda: _v(True, False, None),
    "V2": lambda: _v(True, False, ""),
    "V3": lambda: _v(True, True, None),
    "V4": lambda: _v(True, True, ""),
    "W1": lambda: _body(_history(False)),
    "W2": lambda: _body(_history(False) + [_draft(False)]),
    "W3": lambda: _body(_history(False) + [_draft(False), _nudge()]),
    "W4": lambda: _body(_history(False) + [_draft(True), _nudge()]),
    "W5": lambda: _body(_history(False) + [_call_turn(2, "4*3", reasoning=False)]),
    "W6": lambda: _body(_history(True) + [_draft(True), _nudge()]),
}


@dataclass(frozen=True)
class Expected:
    raw: int  # the live API's answer to the body as built (the seed's probes)
    stripped: int  # after strip() with default options
    passthrough: int  # after strip(passthrough=True): the body unchanged
    no_rewrite: int  # after strip(rewrite_nudge=False)
    mode: str  # strip()'s mode with default options
    stripped_indexes: tuple[int, ...]  # messages that lose reasoning_content
    nudge_rewritten: bool


EXPECTED: dict[str, Expected] = {
    "V0": Expected(200, 200, 200, 200, "lenient", (2, 4), False),
    "V1": Expected(200, 200, 200, 200, "lenient", (4,), False),
    "V2": Expected(200, 200, 200, 200, "lenient", (4,), False),
    "V3": Expected(200, 200, 200, 200, "lenient", (), False),
    "V4": Expected(200, 200, 200, 200, "lenient", (), False),
    "W1": Expected(200, 200, 200, 200, "lenient", (), False),
    "W2": Expected(400, 400, 400, 400, "strict", (), False),  # a bare draft: nothing can fix it
    "W3": Expected(400, 200, 400, 400, "lenient", (), True),  # the nudge rewrite makes it lenient
    "W4": Expected(400, 200, 400, 400, "lenient", (6,), True),
    "W5": Expected(400, 400, 400, 400, "strict", (), False),
    "W6": Expected(200, 200, 200, 200, "lenient", (2, 4, 6), True),
}
