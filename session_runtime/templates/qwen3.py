"""Qwen3 format (as its chat template renders it):

    <|im_start|>system\n{system}{tools}<|im_end|>\n
    <|im_start|>user\n{u}<|im_end|>\n
    <|im_start|>assistant\n<think>\n{r}\n</think>\n\n{a}<tool_call>...</tool_call><|im_end|>\n
    <|im_start|>user\n<tool_response>\n{result}\n</tool_response><|im_end|>\n

A turn that drops its reasoning renders its assistant messages as the answer
alone, as Qwen3's template does for turns before the last user query.
"""

from __future__ import annotations

import dataclasses
import json
import re
import unicodedata
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

# The official text (Qwen3's chat template); the schemas go between the two parts.
_TOOLS = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
_TOOLS_END = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)
_CALL = re.compile(r"<tool_call>\n(.*?)\n</tool_call>", re.S)


def _openai_tool(tool: dict) -> dict:
    """The whole OpenAI tool object, as SGLang, vLLM and transformers pass it to the
    template (`tool | tojson`); a bare function is wrapped."""
    return tool if isinstance(tool, dict) and "function" in tool else {"type": "function", "function": tool_schema(tool)}


def _calls(content: str, calls: Sequence[ToolCall]) -> list[Piece]:
    """The official tool-call markup after `content`: a newline before each call
    but a first one that follows no content; names and arguments are client text."""
    out: list[Piece] = []
    for i, c in enumerate(calls):
        out += [("\n" if i or content else "", True), ('<tool_call>\n{"name": "', True), (c.name, False),
                ('", "arguments": ', True), (json.dumps(c.arguments, ensure_ascii=False), False), ("}\n</tool_call>", True)]
    return out


class Qwen3Template:
    name = "qwen3"
    call_marker = "<tool_call>"  # where tool-call markup starts in the answer text

    def __init__(self, tok: Tokenizer):
        self.tok = tok
        self.im_start = tok.token_id("<|im_start|>")
        self.im_end = tok.token_id("<|im_end|>")
        self.think = tok.token_id("<think>")
        self.end_think = tok.token_id("</think>")
        self.endoftext = tok.token_id("<|endoftext|>")
        self.tool_call = tok.token_id("<tool_call>")
        self.end_tool_call = tok.token_id("</tool_call>")
        self.tool_response = tok.token_id("<tool_response>")
        self.end_tool_response = tok.token_id("</tool_response>")
        self.newline = tok.encode("\n")
        self._renders = RenderCache()  # a render that extends an earlier one walks only the new messages

    @property
    def stop_token_ids(self) -> frozenset[int]:
        return frozenset({self.im_end, self.endoftext})

    def _header(self, role: str) -> list[int]:
        return [self.im_start, *self.tok.encode(f"{role}\n")]

    def _block(self, pieces: Sequence[Piece]) -> list[int]:
        """`<|im_start|>` + one run (role header and text tokenize together, as
        the official rendering's) + `<|im_end|>\n`."""
        return [self.im_start, *self.tok.encode_pieces(pieces), self.im_end, *self.newline]

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
        if _adds_prompt(messages, generation_prompt):
            out.add("generation_prompt", self._header("assistant"))
        return out

    def rendered_length(self, system: Optional[str], tools: Sequence[dict], messages: Sequence[Message],
                        keep: KeepReasoning, generation_prompt: bool = True) -> int:
        """len(render(...).ids), without copying a rendering the cache holds."""
        n = self._renders.length(system, tools, messages, keep)
        if n is None:
            return len(self.render(system, tools, messages, keep, generation_prompt).ids)
        return n + (len(self._header("assistant")) if _adds_prompt(messages, generation_prompt) else 0)

    def _render_head(self, out: Rendered, system: Optional[str], tools: Sequence[dict]) -> None:
        if tools:
            pieces: list[Piece] = [("system\n", True)]
            if system is not None:
                pieces += [(system, False), ("\n\n", True)]
            schemas = [p for t in tools for p in (("\n", True), (json.dumps(_openai_tool(t), ensure_ascii=False), False))]
            out.add("system", self._block([*pieces, (_TOOLS, True), *schemas, (_TOOLS_END, True)]))
        elif system is not None:
            out.add("system", self._block([("system\n", True), (system, False)]))

    def _render_group(self, out: Rendered, role: str, group: list[Message], kept: bool) -> None:
        if role == "user":
            out.add("user", self._block([("user\n", True), (group[0].content, False)]))
        elif role == "assistant":
            self._render_assistant(out, group[0], kept)
        else:
            pieces = [("user", True)]
            for m in group:
                pieces += [("\n<tool_response>\n", True), (m.content, False), ("\n</tool_response>", True)]
            out.add("tool_result", self._block(pieces))

    def _render_assistant(self, out: Rendered, msg: Message, keep: bool) -> None:
        ids = list(msg.output_ids)
        if ids and ids[-1] in self.stop_token_ids:
            ids = ids[:-1]
        if keep:  # inside the open turn: exactly as generated (think block, answer, calls)
            out.add("generation_prompt", self._header("assistant"))
            out.add("output", ids)
            out.add("eos", [self.im_end, *self.newline])
            return
        # A closed turn that dropped its reasoning: the official rendering of the
        # message's content and calls, header and answer as one run; the generated
        # answer when that is not the same text (markup that did not parse).
        answer = ids[ids.index(self.end_think) + 1 :] if self.end_think in ids else ids
        pieces = [(msg.content, False), *_calls(msg.content, msg.tool_calls)]
        text = unicodedata.normalize("NFC", "".join(p for p, _ in pieces))  # as the tokenizer normalizes
        if text.strip("\n") == self.tok.decode(answer).strip("\n"):
            out.add("answer", self._block([("assistant\n", True), *pieces]))
        else:
            out.add("answer", [*self._header("assistant"), *answer, self.im_end, *self.newline])

    def strip_reasoning(self, msg: Message) -> Message:
        """The canonical form of an assistant message whose turn drops its reasoning."""
        ids = list(msg.output_ids)
        answer = ids[ids.index(self.end_think) + 1 :] if self.end_think in ids else ids
        return dataclasses.replace(msg, reasoning="", output_ids=(self.think, self.end_think, *answer))

    def forced_ids(self, reasoning: str, content: str, tool_calls: Sequence[ToolCall] = ()) -> list[int]:
        """An assistant output given as text, as the official template writes the
        last assistant message: reasoning and content stripped of the newlines it
        adds itself; the call markup the template's, names and arguments text."""
        # The template prints the content left-stripped but puts the newline before
        # the first call when the content as given is non-empty ("\n" included).
        answer = self.tok.encode_pieces([("\n\n", True), (content.lstrip("\n"), False), *_calls(content, tool_calls)])
        return [self.think, *self.tok.encode_text(f"\n{reasoning.strip(chr(10))}\n"), self.end_think, *answer,
                self.im_end]

    def parse_output(self, ids: Sequence[int], call_id_base: str) -> ParsedOutput:
        ids = list(ids)
        ended = bool(ids) and ids[-1] in self.stop_token_ids
        if ended:
            ids = ids[:-1]
        if self.end_think in ids:
            cut = ids.index(self.end_think)
            reasoning_ids, answer = ids[:cut], ids[cut + 1 :]
        else:
            reasoning_ids, answer = ids, []
        reasoning = self.tok.decode(reasoning_ids).replace("<think>", "", 1).strip("\n")
        text = self.tok.decode(answer)
        calls = []
        for k, body in enumerate(_CALL.findall(text)):
            try:
                obj = json.loads(body)
                calls.append(ToolCall(f"{call_id_base}_{k}", str(obj["name"]), dict(obj.get("arguments") or {})))
            except (ValueError, KeyError, TypeError):
                continue  # malformed call text stays in the content
        content = text.split("<tool_call>")[0].strip("\n") if calls else text.strip("\n")
        return ParsedOutput(reasoning_ids, answer, content, tuple(calls), ended, reasoning)


def _adds_prompt(messages: Sequence[Message], generation_prompt: bool) -> bool:
    """Does the rendering end with the assistant's header (asked for, after another role's message)?"""
    return generation_prompt and bool(messages) and messages[-1].role != "assistant"
