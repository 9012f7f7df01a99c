"""A step's grammar: an xgrammar structural tag (the format SGLang's
`structural_tag` sampling parameter takes too) in the chat template's own
writing.

The template says how it writes an answer and a call: the text it writes for
an output with a sentinel answer, or a call with a sentinel argument
(`forced_ids`), is cut around the sentinel, so the grammar's fixed text is the
template's, its control tokens (`<tool_call>`) are those tokens and never their
spelling in pieces, and the parts the model chooses are a JSON schema in the
template's argument style (JSON, or DeepSeek's DSML parameters). The reasoning
block comes first and is free, up to a budget, and closes with the reasoning
end token: the embedded engine follows it itself and the grammar starts after
it (`whole_tag` writes both as one tag for SGLang); after the grammar only the
stop tokens it is compiled with are admitted (the template's).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Optional, Sequence

from session_runtime.constrained import dsml
from session_runtime.constrained.spec import OutputConstraint
from session_runtime.errors import InvalidRequest
from session_runtime.templates.base import Template, ToolCall, tool_schema

_SENTINEL = "\ue004"
_DSML_PARAMETER = (f"<{dsml.DSML}parameter", f"</{dsml.DSML}parameter>")
# Whitespace a JSON value may hold in a row: room to indent pretty-printed JSON,
# never a run that eats the output budget (random weights would write one).
MAX_WHITESPACE = 16


@dataclass(frozen=True)
class _Piece:
    text: str
    token: Optional[int] = None  # an added token (control token or markup), written as that token


def structural_tag(tpl: Template, tools: Sequence[dict], constraint: OutputConstraint) -> Optional[str]:
    """The structural tag (JSON text) of the answer, which starts after the
    reasoning block, or None when `constraint` shapes nothing. Raises
    InvalidRequest naming the field the template cannot honour."""
    if not constraint.shapes_output or (constraint.no_call and not tools and constraint.answer_schema is None):
        return None
    if constraint.no_call and constraint.answer_schema is None:
        return _no_call(tpl, tools, constraint.tools_field)
    choices = []  # the outputs the step may have: a call of each tool it may call, an answer in the schema
    if constraint.call or (tools and not constraint.no_call):
        choices += [_sequence(_call_format(tpl, tool, constraint.tools_field))
                    for tool in _called(tools, constraint.tools, constraint.tools_field)]
    if not constraint.call:  # with tools, as OpenAI's structured outputs: a call, or the answer in its schema
        before, _ = _around(_answer_pieces(tpl), _SENTINEL, _SENTINEL)
        choices.append(_sequence([*_formats(before), _json(json.loads(constraint.answer_schema))]))
    form = choices[0] if len(choices) == 1 else {"type": "or", "elements": choices}
    tag = json.dumps({"type": "structural_tag", "format": form}, ensure_ascii=False)
    _check(tag, "tools" if constraint.call else constraint.schema_field)
    return tag


def _called(tools: Sequence[dict], names: tuple[str, ...], field: str) -> list[dict]:
    """The tools a forced call may name: `names` (every tool when none), in
    order. Raises InvalidRequest naming `field` for a name the conversation has
    no tool of, or no tools at all."""
    by_name = {tool_schema(t).get("name"): tool_schema(t) for t in tools}
    if not by_name:
        raise InvalidRequest(f"{field}: a tool call is required, but there are no tools to call", param=field)
    for name in names:
        if name not in by_name:
            known = ", ".join(repr(n) for n in by_name)
            raise InvalidRequest(f"{field}: there is no tool named {name!r} (the tools are {known})", param=field)
    return [by_name[n] for n in (names or tuple(by_name))]


def _check(tag: str, field: str) -> None:
    """Raise InvalidRequest naming `field` when xgrammar cannot build the
    grammar (a schema it does not support), before any backend sees it."""
    import xgrammar as xgr

    try:
        xgr.Grammar.from_structural_tag(tag)
    except Exception as exc:  # xgrammar raises RuntimeError, ValueError or its own errors
        raise InvalidRequest(f"{field}: the schema cannot be turned into a grammar: {exc}", param=field) from None


def whole_tag(answer: Optional[str], think_end: Optional[int], think_budget: Optional[int],
              stop_token_ids: Sequence[int]) -> Optional[str]:
    """One structural tag for the whole output, reasoning block included (what
    SGLang's `structural_tag` takes): the reasoning free of stop tokens, at
    most `think_budget` tokens, then `think_end`, then the answer's format
    (free when `answer` is None). The embedded engine follows the reasoning
    block itself (constrained/matcher.py), which costs xgrammar nothing."""
    if think_end is None:
        return answer
    free = {"type": "any_tokens", "exclude_tokens": sorted({think_end, *stop_token_ids})}
    if think_budget is not None:
        free["max_tokens"] = max(think_budget, 0)
    rest = json.loads(answer)["format"] if answer is not None else {
        "type": "any_tokens", "exclude_tokens": sorted(set(stop_token_ids))}
    return json.dumps({"type": "structural_tag", "format": {
        "type": "sequence", "elements": [free, {"type": "token", "token": think_end}, rest]}}, ensure_ascii=False)


def _no_call(tpl: Template, tools: Sequence[dict], field: str) -> str:
    """A free answer that never starts a call: without the added token the
    template's call markup starts with. Raises InvalidRequest where the
    markup has none (the template spells it in plain text)."""
    tool = tool_schema(tools[0])
    before = [p for p in _call_format(tpl, tool, field) if p.get("type") == "token"]
    if not before:
        raise InvalidRequest(f"{field}: this model's chat template writes tool calls in plain text, so \"none\" "
                             "cannot keep it from calling; leave the tools out instead", param=field)
    free = {"type": "any_tokens", "exclude_tokens": sorted({before[0]["token"], *tpl.stop_token_ids})}
    return json.dumps({"type": "structural_tag", "format": free})


def end_think(tpl: Template) -> Optional[int]:
    """The token that ends the template's reasoning block (None: it has none)."""
    return tpl.tok.inner.token_to_id("</think>")


def _json(schema: object) -> dict:
    return {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": MAX_WHITESPACE}


def _sequence(elements: list[dict]) -> dict:
    return elements[0] if len(elements) == 1 else {"type": "sequence", "elements": elements}


def call_style(tpl: Template, field: str) -> str:
    """How the template writes a call's arguments: json (Hermes markup:
    Qwen3, and `hf` templates that write it) or dsml (DeepSeek V3.2)."""
    family = tpl.name if tpl.name != "hf" else getattr(getattr(tpl, "parser", None), "family", "")
    style = {"qwen3": "json", "hermes": "json", "deepseek": "dsml"}.get(family)
    if style is None:
        raise InvalidRequest(f"{field}: this model's chat template writes tool calls in a syntax this server "
                             "cannot constrain yet (it can for Qwen3/Hermes and DeepSeek markup)", param=field)
    return style


def _call_format(tpl: Template, tool: dict, field: str) -> list[dict]:
    """One call of `tool` as the template writes it after the reasoning block,
    its arguments following the tool's parameters schema."""
    style = call_style(tpl, field)
    name = tool.get("name", "")
    ids = tpl.forced_ids("r", "", [ToolCall("call_0", name, {_SENTINEL: 0})])
    opening, closing = ("{", "}") if style == "json" else _DSML_PARAMETER
    before, after = _around(_pieces(tpl, _answer_ids(tpl, ids)), opening, closing)
    schema = tool.get("parameters") or {"type": "object"}
    dsml_token = tpl.tok.inner.token_to_id(dsml.DSML)
    middle = [_json(schema)] if style == "json" else dsml.arguments(
        schema, _json, dsml_token if dsml_token in tpl.tok.added_ids else None)
    return [*_formats(before), *middle, *_formats(after)]


def _answer_pieces(tpl: Template) -> list[_Piece]:
    return _pieces(tpl, _answer_ids(tpl, tpl.forced_ids("r", _SENTINEL, [])))


def _answer_ids(tpl: Template, ids: list[int]) -> list[int]:
    """The ids after the reasoning block, without the stop token that ends them."""
    end = end_think(tpl)
    if end is not None and end in ids:
        ids = ids[ids.index(end) + 1:]
    while ids and ids[-1] in tpl.stop_token_ids:
        ids = ids[:-1]
    return ids


def _pieces(tpl: Template, ids: list[int]) -> list[_Piece]:
    """`ids` as text runs and added tokens."""
    out: list[_Piece] = []
    run: list[int] = []
    added = tpl.tok.added_ids
    for i in [*ids, None]:
        if i is None or i in added:
            if run:
                out.append(_Piece(tpl.tok.decode(run)))
                run = []
            if i is not None:
                out.append(_Piece(tpl.tok.decode([i]), i))
        else:
            run.append(i)
    return out


def _around(pieces: list[_Piece], opening: str, closing: str) -> tuple[list[_Piece], list[_Piece]]:
    """The pieces before and after the sentinel's region: from the last
    `opening` before the sentinel to the end of the first `closing` after it
    (the region may span added tokens: DSML's `｜DSML｜`)."""
    text = "".join(p.text for p in pieces)
    at = text.find(_SENTINEL)
    start = text.rfind(opening, 0, at + len(opening) if opening == _SENTINEL else at) if at >= 0 else -1
    stop = text.find(closing, at) if at >= 0 else -1
    if start < 0 or stop < 0:
        raise InvalidRequest("the chat template writes this output in a way the server cannot constrain")
    return _slice(pieces, 0, start), _slice(pieces, stop + len(closing), len(text))


def _slice(pieces: list[_Piece], a: int, b: int) -> list[_Piece]:
    """The pieces covering text[a:b]; a token cut by either end becomes its remaining text."""
    out, pos = [], 0
    for p in pieces:
        lo, hi = max(a, pos), min(b, pos + len(p.text))
        if lo < hi:
            whole = lo == pos and hi == pos + len(p.text)
            out.append(p if whole else _Piece(p.text[lo - pos: hi - pos]))
        pos += len(p.text)
    return out


def _formats(pieces: list[_Piece]) -> list[dict]:
    return [{"type": "token", "token": p.token} if p.token is not None else {"type": "const_string", "value": p.text}
            for p in pieces if p.token is not None or p.text]
