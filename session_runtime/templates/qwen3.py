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
from typing import Optional, Sequence

from session_runtime.templates.base import (
    KeepReasoning,
    Message,
    ParsedOutput,
    Rendered,
    ToolCall,
    message_groups,
    tool_schema,
)
from session_runtime.tokenizer import Tokenizer

_TOOLS = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{schemas}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)
_CALL = re.compile(r"<tool_call>\n(.*?)\n</tool_call>", re.S)


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

    @property
    def stop_token_ids(self) -> frozenset[int]:
        return frozenset({self.im_end, self.endoftext})

    def _header(self, role: str) -> list[int]:
        return [self.im_start, *self.tok.encode(f"{role}\n")]

    def render(
        self,
        system: Optional[str],
        tools: Sequence[dict],
        messages: Sequence[Message],
        keep: KeepReasoning,
        generation_prompt: bool = True,
    ) -> Rendered:
        out = Rendered()
        ids = self.tok.encode_text(system) if system else []
        if tools:
            schemas = "\n".join(json.dumps(tool_schema(t), ensure_ascii=False) for t in tools)
            # The instructions name the call tags: those are the tags' tokens.
            ids += self.tok.encode_text("\n\n") if ids else []
            ids += self._answer_ids(_TOOLS.replace("{schemas}", schemas))
        if ids:
            out.add("system", [*self._header("system"), *ids, self.im_end, *self.newline])
        for role, group in message_groups(messages):
            if role == "user":
                out.add("user", [*self._header("user"), *self.tok.encode_text(group[0].content), self.im_end,
                                 *self.newline])
            elif role == "assistant":
                out.add("generation_prompt", self._header("assistant"))
                self._render_assistant(out, group[0], keep(group[0].turn))
            else:
                ids = [*self._header("user")[:-len(self.newline)]]
                for m in group:
                    ids += [*self.newline, self.tool_response, *self.tok.encode_text(f"\n{m.content}\n"),
                            self.end_tool_response]
                out.add("tool_result", [*ids, self.im_end, *self.newline])
        if generation_prompt and messages and messages[-1].role != "assistant":
            out.add("generation_prompt", self._header("assistant"))
        return out

    def _render_assistant(self, out: Rendered, msg: Message, keep: bool) -> None:
        ids = list(msg.output_ids)
        if ids and ids[-1] in self.stop_token_ids:
            ids = ids[:-1]
        if keep:
            out.add("output", ids)  # exactly as generated: think block, answer, calls
        else:
            answer = ids[ids.index(self.end_think) + 1 :] if self.end_think in ids else ids
            out.add("answer", self._answer_ids(self.tok.decode(answer).lstrip("\n")))
        out.add("eos", [self.im_end, *self.newline])

    def strip_reasoning(self, msg: Message) -> Message:
        """The canonical form of an assistant message whose turn drops its reasoning."""
        ids = list(msg.output_ids)
        answer = ids[ids.index(self.end_think) + 1 :] if self.end_think in ids else ids
        return dataclasses.replace(msg, reasoning="", output_ids=(self.think, self.end_think, *answer))

    def forced_ids(self, reasoning: str, content: str, tool_calls: Sequence[ToolCall] = ()) -> list[int]:
        calls = "".join(
            "\n<tool_call>\n" + json.dumps({"name": c.name, "arguments": c.arguments}, ensure_ascii=False) + "\n</tool_call>"
            for c in tool_calls
        )
        return [self.think, *self.tok.encode_text(f"\n{reasoning}\n"), self.end_think,
                *self._answer_ids(f"\n\n{content}{calls}"), self.im_end]

    def _answer_ids(self, text: str) -> list[int]:
        """Answer text as ids: the tool-call tags the template writes become their
        tokens, everything else stays plain text."""
        ids: list[int] = []
        for i, part in enumerate(re.split(r"(<tool_call>|</tool_call>)", text)):
            if i % 2:
                ids.append(self.tool_call if part == "<tool_call>" else self.end_tool_call)
            elif part:
                ids += self.tok.encode_text(part)
        return ids

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
