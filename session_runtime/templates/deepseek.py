"""DeepSeek V3.2/V4 thinking format (reference: sglang's encoding_dsv32.py).

    <bos>{system}<｜User｜>{u}<｜Assistant｜><think>{r}</think>{a}<eos>
    ... tool calls as DSML text, results as <function_results>, then <think>.

A turn that keeps its reasoning renders `<think>` after the user message and its
assistant messages replay their generated ids; a turn that drops it renders
`</think>` there and only the answer (content and tool calls) after it.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
from typing import Optional, Sequence

from session_runtime.templates.base import (
    KeepReasoning,
    Message,
    ParsedOutput,
    Rendered,
    ToolCall,
    tool_schema,
)
from session_runtime.templates.render_cache import RenderCache
from session_runtime.tokenizer import Piece, Tokenizer

DSML = "｜DSML｜"
# The official text (encoding_dsv32.py's TOOLS_SYSTEM_TEMPLATE, thinking mode).
_TOOLS_HEADER = (
    "## Tools\nYou have access to a set of tools you can use to answer the user's question.\n"
    f'You can invoke functions by writing a "<{DSML}function_calls>" block like the following '
    "as part of your reply to the user:\n"
    f'<{DSML}function_calls>\n<{DSML}invoke name="$FUNCTION_NAME">\n'
    f'<{DSML}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{DSML}parameter>\n'
    f"...\n</{DSML}invoke>\n"
    f'<{DSML}invoke name="$FUNCTION_NAME2">\n...\n</{DSML}invoke>\n'
    f"</{DSML}function_calls>\n"
    "String and scalar parameters should be specified as is without any escaping or quotes, while lists and "
    'objects should use JSON format. The "string" attribute should be set to "true" for string type parameters '
    'and "false" for other types (numbers, booleans, arrays, objects).\n'
    "If the thinking_mode is enabled, then after function results you should strongly consider outputting a "
    "thinking block. Here is an example:\n"
    f"<{DSML}function_calls>\n...\n</{DSML}function_calls>\n"
    "<function_results>\n...\n</function_results>\n"
    "<think>...thinking about results</think>\n"
    "Here are the functions available in JSONSchema format:\n<functions>\n"
)
_TOOLS_FOOTER = "\n</functions>\n"
_INVOKE = re.compile(rf'<{DSML}invoke name="([^"]*)">\n(.*?)\n?</{DSML}invoke>', re.S)
_PARAM = re.compile(rf'<{DSML}parameter name="([^"]*)" string="(true|false)">(.*?)</{DSML}parameter>', re.S)
_CALLS_START = f"\n\n<{DSML}function_calls>"


def _dsml_calls(calls: Sequence[ToolCall]) -> list[Piece]:
    """The tool-call markup as pieces: the template's text trusted, names, keys
    and values the client's (never a control token)."""
    if not calls:
        return []
    out: list[Piece] = [(f"{_CALLS_START}\n", True)]
    for i, call in enumerate(calls):
        out += [("\n" if i else "", True), (f'<{DSML}invoke name="', True), (call.name, False), ('">\n', True)]
        for j, (k, v) in enumerate(call.arguments.items()):
            value = v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)
            out += [("\n" if j else "", True), (f'<{DSML}parameter name="', True), (k, False),
                    (f'" string="{"true" if isinstance(v, str) else "false"}">', True), (value, False),
                    (f"</{DSML}parameter>", True)]
        out.append((f"\n</{DSML}invoke>", True))
    out.append((f"\n</{DSML}function_calls>", True))
    return out


def _parse_calls(text: str, call_id_base: str) -> tuple[str, tuple[ToolCall, ...]]:
    cut = text.find(_CALLS_START)
    if cut < 0:
        return text, ()
    calls = []
    for k, (name, body) in enumerate(_INVOKE.findall(text[cut:])):
        args = {}
        for key, is_str, value in _PARAM.findall(body):
            if is_str == "true":
                args[key] = value
            else:
                try:
                    args[key] = json.loads(value)
                except ValueError:
                    args[key] = value
        calls.append(ToolCall(id=f"{call_id_base}_{k}", name=name, arguments=args))
    return text[:cut], tuple(calls)


class DeepSeekTemplate:
    name = "deepseek"
    call_marker = _CALLS_START  # where tool-call markup starts in the answer text

    def __init__(self, tok: Tokenizer):
        self.tok = tok
        self.bos = tok.token_id("<｜begin▁of▁sentence｜>")
        self.eos = tok.token_id("<｜end▁of▁sentence｜>")
        self.user = tok.token_id("<｜User｜>")
        self.assistant = tok.token_id("<｜Assistant｜>")
        self.think = tok.token_id("<think>")
        self.end_think = tok.token_id("</think>")
        # A render walks every message of the conversation, and each step renders
        # it a few times: an assistant message's spans are a function of its ids
        # and whether it keeps its reasoning, a run of tool results' ids of their
        # texts. Both memoized per template (the tokenizer memoizes text too).
        self._assistant_spans = functools.lru_cache(maxsize=16384)(self._assistant_spans_of)
        self._results_ids = functools.lru_cache(maxsize=16384)(self._results_ids_of)
        self._renders = RenderCache()  # a render that extends an earlier one walks only the new messages

    @property
    def stop_token_ids(self) -> frozenset[int]:
        return frozenset({self.eos})

    def _marker(self, out: Rendered, keep: bool) -> None:
        # Where the assistant's output starts: open a think block, or skip it.
        out.add("think_open", [self.think]) if keep else out.add("think_skip", [self.end_think])

    def render(
        self,
        system: Optional[str],
        tools: Sequence[dict],
        messages: Sequence[Message],
        keep: KeepReasoning,
        generation_prompt: bool = True,
    ) -> Rendered:
        out = self._renders.render(system, tools, messages, keep, lambda o: self._render_head(o, system, tools),
                                   self._render_group)
        if _unasked_prompt(messages, generation_prompt):
            last = out.spans.pop()  # the trailing marker is the generation prompt
            del out.ids[last.start :]
        return out

    def rendered_length(self, system: Optional[str], tools: Sequence[dict], messages: Sequence[Message],
                        keep: KeepReasoning, generation_prompt: bool = True) -> int:
        """len(render(...).ids), without copying a rendering the cache holds."""
        n = self._renders.length(system, tools, messages, keep,
                                 without_last_span=_unasked_prompt(messages, generation_prompt))
        return n if n is not None else len(self.render(system, tools, messages, keep, generation_prompt).ids)

    def _render_head(self, out: Rendered, system: Optional[str], tools: Sequence[dict]) -> None:
        out.add("bos", [self.bos])
        pieces: list[Piece] = [(system or "", False)]
        if tools:  # the official header follows the system text (even none) after a blank line
            schemas = "\n".join(json.dumps(tool_schema(t), ensure_ascii=False) for t in tools)
            pieces += [("\n\n" + _TOOLS_HEADER, True), (schemas, False), (_TOOLS_FOOTER, True)]
        out.add("system", self.tok.encode_pieces(pieces))

    def _render_group(self, out: Rendered, role: str, group: list[Message], kept: bool) -> None:
        if role == "user":
            out.add("user", [self.user, *self.tok.encode_text(group[0].content), self.assistant])
            self._marker(out, kept)
        elif role == "assistant":
            self._render_assistant(out, group[0], kept)
        else:
            self._render_results(out, group, kept)

    def _render_assistant(self, out: Rendered, msg: Message, keep: bool) -> None:
        for kind, ids in self._assistant_spans(tuple(msg.output_ids), keep):
            out.add(kind, ids)

    def _assistant_spans_of(self, output_ids: tuple[int, ...], keep: bool) -> tuple[tuple[str, tuple[int, ...]], ...]:
        parsed = self.parse_output(output_ids, "")
        if keep:  # inside the open turn: exactly the generated sequence
            spans = [("reasoning", parsed.reasoning_ids),
                     ("reasoning_end", [self.end_think] if self.end_think in output_ids else []),
                     ("answer", parsed.answer_ids)]
        else:  # a closed turn that dropped its reasoning: the official rendering
            spans = [("answer", self._official_answer(parsed))]
        return tuple((kind, tuple(ids)) for kind, ids in (*spans, ("eos", [self.eos])))

    def _official_answer(self, parsed: ParsedOutput) -> list[int]:
        """The answer's ids as the official renderer tokenizes its text (content
        and calls as one string); the generated ids when the calls do not
        render back to the same text (malformed markup)."""
        ids = self.tok.encode_pieces([(parsed.content, False), *_dsml_calls(parsed.tool_calls)])
        return ids if ids == parsed.answer_ids or self.tok.decode(ids) == self.tok.decode(parsed.answer_ids) \
            else parsed.answer_ids

    def _render_results(self, out: Rendered, results: Sequence[Message], keep: bool) -> None:
        out.add("tool_result", self._results_ids(tuple(m.content for m in results)))
        self._marker(out, keep)

    def _results_ids_of(self, contents: tuple[str, ...]) -> tuple[int, ...]:
        pieces: list[Piece] = [("\n\n<function_results>", True)]
        for content in contents:
            pieces += [("\n<result>", True), (content, False), ("</result>", True)]
        return tuple(self.tok.encode_pieces([*pieces, ("\n</function_results>\n\n", True)]))

    def forced_ids(self, reasoning: str, content: str, tool_calls: Sequence[ToolCall] = ()) -> list[int]:
        """Ids of an assistant output given as text (trace replay, client history)."""
        # Content and the call markup tokenize as one string, as the official
        # renderer's; the markup's tokens are the template's, the client's text
        # (reasoning, content, names, arguments) never becomes a control token.
        answer = self.tok.encode_pieces([(content, False), *_dsml_calls(tool_calls)])
        return [*self.tok.encode_text(reasoning), self.end_think, *answer, self.eos]

    def parse_output(self, ids: Sequence[int], call_id_base: str) -> ParsedOutput:
        ids = list(ids)
        ended = bool(ids) and ids[-1] == self.eos
        if ended:
            ids = ids[:-1]
        if self.end_think in ids:
            cut = ids.index(self.end_think)
            reasoning, answer = ids[:cut], ids[cut + 1 :]
        else:  # still thinking when the output stopped
            reasoning, answer = ids, []
        content, calls = _parse_calls(self.tok.decode(answer), call_id_base)
        return ParsedOutput(reasoning, answer, content, calls, ended, self.tok.decode(reasoning))

    def strip_reasoning(self, msg: Message) -> Message:
        """The canonical form of an assistant message whose turn drops its
        reasoning: no reasoning text, ids holding only the answer."""
        answer = self.parse_output(msg.output_ids, "").answer_ids
        return dataclasses.replace(msg, reasoning="", output_ids=(self.end_think, *answer, self.eos))


def _unasked_prompt(messages: Sequence[Message], generation_prompt: bool) -> bool:
    """Does the rendering end with a generation prompt that was not asked for (a
    group other than an assistant's ends with the assistant's marker)?"""
    return not generation_prompt and bool(messages) and messages[-1].role != "assistant"
