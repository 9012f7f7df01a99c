"""Reading a model's output back for template `hf`: where its reasoning ends and
which tool calls its answer makes, by the markup its chat template writes.

One parser per markup family, picked by what the template's text shows:
ChatML/Hermes (`<tool_call>{json}</tool_call>`: Qwen2.5, Qwen3), GLM-4.5
(`<tool_call>name<arg_key>..`), gpt-oss (harmony channels), Llama 3 (a JSON
object as the whole answer). Each accepts the form the template writes for a
call (what forced and imported outputs are), so an output reads back as it was
written.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Optional, Sequence

from session_runtime.templates.base import ToolCall

_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)
_GLM = re.compile(r"<tool_call>([^<\n]*)\n?(.*?)</tool_call>", re.S)
_GLM_ARG = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)
_HARMONY_CALL = re.compile(r"to=functions\.([^\s<]+)\s*(?:<\|channel\|>commentary)?\s*(?:<\|constrain\|>)?\s*json"
                           r"<\|message\|>(.*?)(?:<\|call\|>|$)", re.S)
_HARMONY_ANALYSIS = re.compile(r"<\|channel\|>analysis<\|message\|>(.*?)<\|end\|>", re.S)
_HARMONY_OPEN_ANALYSIS = re.compile(r"\s*<\|channel\|>analysis<\|message\|>(.*)", re.S)
_HARMONY_FINAL = re.compile(r"<\|channel\|>final<\|message\|>(.*?)(?:<\|return\|>|<\|end\|>|$)", re.S)


def _glm_value(text: str):
    """GLM writes a string argument as is and anything else as JSON."""
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return text if isinstance(value, str) else value


def _json_object(text: str) -> Optional[dict]:
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


@dataclass(frozen=True)
class OutputParser:
    family: str  # hermes, glm, harmony, llama3, plain
    call_marker: str  # where call markup starts in the answer text

    def split(self, ids: Sequence[int], tok) -> tuple[str, int]:
        """(reasoning, index in `ids` where the answer starts): after `</think>`, or
        after the `<|end|>` that closes a harmony analysis message."""
        end = {"harmony": "<|end|>"}.get(self.family, "</think>")
        end_id = tok.inner.token_to_id(end)
        if end_id is None or end_id not in ids:
            if self.family == "harmony":  # an analysis message still being written: reasoning so far
                m = _HARMONY_OPEN_ANALYSIS.match(tok.decode(ids))
                return (m.group(1), len(ids)) if m else ("", 0)
            return "", 0
        cut = list(ids).index(end_id) + 1
        text = tok.decode(ids[:cut])
        if self.family == "harmony":
            m = _HARMONY_ANALYSIS.search(text)
            return (m.group(1), cut) if m else ("", 0)
        return text[: -len(end)].replace("<think>", "", 1).strip("\n"), cut

    def calls(self, text: str, call_id_base: str) -> tuple[str, tuple[ToolCall, ...]]:
        """(content, tool calls) of the answer text; malformed call markup stays content."""
        found: list[tuple[str, dict]] = []
        content = text
        if self.family == "hermes":
            for body in _HERMES.findall(text):
                obj = _json_object(body)
                if obj is not None and isinstance(obj.get("name"), str):
                    found.append((obj["name"], obj.get("arguments") or {}))
            if found:
                content = text.split("<tool_call>")[0]
        elif self.family == "glm":
            for name, body in _GLM.findall(text):
                args = {k: _glm_value(v) for k, v in _GLM_ARG.findall(body)}
                found.append((name.strip(), args))
            if found:
                content = text.split("<tool_call>")[0]
        elif self.family == "harmony":
            for name, body in _HARMONY_CALL.findall(text):
                obj = _json_object(body)
                if obj is not None:
                    found.append((name, obj))
            final = _HARMONY_FINAL.search(text)
            # Only a final message is content: text before a channel is its header (" to=functions.f").
            content = final.group(1) if final else ""
        elif self.family == "llama3":
            obj = _json_object(text.strip())
            if obj is not None and isinstance(obj.get("name"), str) and isinstance(obj.get("parameters"), dict):
                found.append((obj["name"], obj["parameters"]))
                content = ""
        calls = tuple(ToolCall(f"{call_id_base}_{k}", name, args if isinstance(args, dict) else {})
                      for k, (name, args) in enumerate(found))
        return content.strip("\n"), calls


def parser_for(chat_template: str) -> OutputParser:
    if "<|channel|>" in chat_template:
        return OutputParser("harmony", "to=functions.")
    if "<arg_key>" in chat_template:
        return OutputParser("glm", "<tool_call>")
    if "<tool_call>" in chat_template:
        return OutputParser("hermes", "<tool_call>")
    if "<|start_header_id|>" in chat_template:
        return OutputParser("llama3", '{"name"')
    return OutputParser("plain", "\ue002")
