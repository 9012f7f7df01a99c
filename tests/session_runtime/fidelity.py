"""Conversations for the template fidelity suite, and the official renderers.

A conversation is (system, tools, turns): system is None, "" or text; tools
OpenAI function objects; each turn a user message and its assistant steps
(reasoning, content, tool calls, tool results). The last turn is open: it ends
after its user message or after some tool results, so every conversation asks
for a generation prompt, as a step does. Text never spells a control token
(forged markers are the injection tests' subject).
"""

from __future__ import annotations

import json

from hypothesis import strategies as st

from session_runtime.templates.base import Message, ToolCall

ALPHABET = st.sampled_from(list("abcdefghijklmnopqrstuvwxyz ABCXYZ.,;:!?-_()[]{}'\"\n\t0123456789<>/=*#")
                           + ["é", "中文", "😀", "  ", "\n\n", " the", " Hello", "...", "ü", "e\u0301", "Å"])


def text(lo: int = 0, hi: int = 24):
    return st.lists(ALPHABET, min_size=lo, max_size=hi).map("".join)


values = st.one_of(text(0, 10), st.integers(-5, 100), st.booleans(), st.none(), st.floats(-3, 3, allow_nan=False),
                   st.lists(st.integers(0, 9), max_size=3), st.dictionaries(st.sampled_from("xyz"), text(0, 5), max_size=2))
arguments = st.dictionaries(st.sampled_from(["query", "path", "n", "flag", "items", "obj"]), values, max_size=3)


@st.composite
def conversations(draw):
    system = draw(st.one_of(st.none(), st.just(""), text(1, 40)))
    tools = [{"type": "function", "function": {
        "name": f"tool_{i}", "description": draw(text(0, 30)),
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}}
        for i in range(draw(st.integers(0, 2)))]
    names = [t["function"]["name"] for t in tools]
    turns = []
    for t in range(draw(st.integers(1, 3))):
        steps = []
        for k in range(draw(st.integers(0, 2)) if tools else 0):
            calls = [ToolCall(f"call_{t}_{k}_{j}", draw(st.sampled_from(names)), draw(arguments))
                     for j in range(draw(st.integers(1, 2)))]
            steps.append((draw(text(0, 20)), draw(st.one_of(st.sampled_from(["", "\n", "\n\n"]), text(1, 20))), calls,
                          [draw(text(0, 20)) for _ in calls]))
        steps.append((draw(text(1, 20)), draw(text(0, 20)), [], []))
        turns.append((draw(text(1, 30)), steps))
    user, steps = turns[-1]
    turns[-1] = (user, [s for s in steps if s[2]][: draw(st.integers(0, 2))])  # the open turn
    return system, tools, turns


def official_messages(system, tools, turns) -> list[dict]:
    """The conversation as OpenAI chat messages (reasoning as `reasoning_content`)."""
    msgs = []
    if system is not None:
        msgs.append({"role": "system", "content": system})
    for user, steps in turns:
        msgs.append({"role": "user", "content": user})
        for reasoning, content, calls, results in steps:
            m = {"role": "assistant", "content": content, "reasoning_content": reasoning}
            if calls:
                m["tool_calls"] = [{"type": "function", "id": c.id, "function": {
                    "name": c.name, "arguments": json.dumps(c.arguments, ensure_ascii=False)}} for c in calls]
            msgs.append(m)
            msgs += [{"role": "tool", "tool_call_id": c.id, "content": r} for c, r in zip(calls, results)]
    return msgs


def deepseek_official(tok, system, tools, turns) -> list[int]:
    """`encode_messages` (SGLang's DeepSeek V3.2 encoder, thinking mode, closed
    turns' reasoning dropped), tokenized whole by the DeepSeek tokenizer."""
    from sglang.srt.entrypoints.openai.encoding_dsv32 import encode_messages

    msgs = official_messages(system, tools, turns)
    if tools:  # the encoder reads tools from the system message
        if msgs and msgs[0]["role"] == "system":
            msgs[0] = {**msgs[0], "tools": tools}
        else:
            msgs.insert(0, {"role": "system", "content": "", "tools": tools})
    return tok.encode(encode_messages(msgs, thinking_mode="thinking"))


def ours(tpl, system, tools, turns) -> list[int]:
    """Our template's prompt for the next step under `drop`: closed turns drop
    their reasoning, the open turn keeps it; assistant outputs are the ids the
    import path gives them (`forced_ids`)."""
    last = len(turns) - 1
    return tpl.render(system, tools, messages(tpl, turns), lambda turn: turn == last, True).ids


def messages(tpl, turns) -> list[Message]:
    """The turns as the runtime's messages (assistant outputs as `forced_ids` gives them)."""
    msgs = []
    for t, (user, steps) in enumerate(turns):
        msgs.append(Message("user", t, content=user))
        for reasoning, content, calls, results in steps:
            ids = tpl.forced_ids(reasoning, content, calls)
            msgs.append(Message("assistant", t, content=content, reasoning=reasoning, tool_calls=tuple(calls),
                                output_ids=tuple(ids)))
            msgs += [Message("tool", t, content=r, tool_call_id=c.id) for c, r in zip(calls, results)]
    return msgs


QWEN3_TEMPLATE = __import__("pathlib").Path(__file__).parents[1] / "data" / "qwen3_chat_template.jinja"


def qwen3_official(tok, system, tools, turns) -> list[int]:
    """Qwen3's official chat template (tests/data), rendered by transformers'
    Jinja environment with the generation prompt, tokenized whole."""
    from transformers.utils.chat_template_utils import render_jinja_template

    prompt = render_jinja_template([official_messages(system, tools, turns)], tools=tools or None,
                                   chat_template=QWEN3_TEMPLATE.read_text(), add_generation_prompt=True)[0][0]
    return tok.encode(prompt)


def qwen3_deviates(system, tools, turns) -> bool:
    """The documented deviation: inside the open turn an assistant step with no
    reasoning keeps its (empty) think block, as generated; the official
    template drops it from every step but the last (prefix stability wins)."""
    return any(not reasoning.strip("\n") for reasoning, *_ in turns[-1][1])


def hf_official(folder, tok, tpl, system, tools, turns) -> list[int]:
    """A folder's chat template rendered as SGLang's server renders it (tool-call
    arguments parsed into objects, reasoning in the field the template reads),
    by transformers' Jinja environment with the generation prompt, tokenized
    whole by the folder's tokenizer."""
    from transformers.utils.chat_template_utils import render_jinja_template

    from session_runtime.templates.official import read_chat_template, special_token_kwargs

    msgs = official_messages(system, tools, turns)
    for m in msgs:
        if m["role"] == "assistant":
            m[tpl._thinking_field] = m.pop("reasoning_content")
            for c in m.get("tool_calls", ()):
                c["function"]["arguments"] = json.loads(c["function"]["arguments"])
    # The template's own clock, as the renderer pins it (the day it was built): a run past midnight compares
    # the same date (official.OfficialRenderer.strftime_now).
    prompt = render_jinja_template([msgs], tools=tools or None, chat_template=read_chat_template(folder),
                                   add_generation_prompt=True, strftime_now=tpl.official.strftime_now,
                                   **special_token_kwargs(folder))[0][0]
    return tok.encode(prompt)
