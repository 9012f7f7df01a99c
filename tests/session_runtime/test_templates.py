"""Rendering is prefix-stable: under every policy, a history plus one more message
renders to an extension of the history's rendering, and a step's prompt plus
its generated ids is a prefix of the next prompt while the turn is open. The
only change is the fork when a turn closes and drops its reasoning."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from session_runtime.policies import POLICIES, ReasoningPolicy
from session_runtime.templates import DeepSeekTemplate, Message, ToolCall
from session_runtime.templates.qwen3 import Qwen3Template
from session_runtime.tokenizer import deepseek_tokenizer, qwen3_tokenizer
from session_runtime.turns import common_prefix

TEMPLATES = {"deepseek": DeepSeekTemplate(deepseek_tokenizer()), "qwen3": Qwen3Template(qwen3_tokenizer())}
HF = ("hf-qwen3", "hf-qwen2.5", "hf-llama3", "hf-gpt-oss", "hf-glm4.5")  # template `hf` over each family's folder
ONE_CALL = {"hf-llama3", "hf-gpt-oss"}  # their templates take one tool call per message
BARE_CALLS = {"hf-gpt-oss"}  # its template refuses content and reasoning together on a tool call
TOOLS = [{"type": "function", "function": {"name": "f", "description": "F.", "parameters": {
    "type": "object", "properties": {"k": {"type": "integer"}}}}}]


def template(name: str):
    if name.startswith("hf-"):
        from tests.session_runtime.hf_folders import family

        return family(name[3:])[2]
    return TEMPLATES[name]

text = st.lists(st.sampled_from(["alpha", " beta", "\n", "42", " 你好", "{", "}", " x=1", "\n\n", "é"]),
                min_size=0, max_size=6).map("".join)
nonempty = text.filter(lambda s: s.strip() != "")
step = st.tuples(text, text, st.integers(0, 2))  # reasoning, content, tool calls
turn = st.tuples(nonempty, st.lists(step, min_size=1, max_size=3))
conversation = st.lists(turn, min_size=1, max_size=4)


def script(tpl, turns, one_call: bool = False, bare_calls: bool = False):
    """Yield ('gen', assistant message, closes_turn) and ('msg', [messages]) events.
    A step's tool results arrive together, as the runtime requires."""
    for t, (user, steps) in enumerate(turns):
        yield "msg", [Message("user", t, user)], None
        for s, (reasoning, content, ncalls) in enumerate(steps):
            last = s == len(steps) - 1
            n = 1 if one_call else max(ncalls, 1)
            calls = () if last else tuple(ToolCall(f"c{t}{s}{k}", "f", {"k": k}) for k in range(n))
            content = "" if calls and bare_calls else content
            ids = tuple(tpl.forced_ids(reasoning, content, calls))
            yield "gen", Message("assistant", t, content, reasoning, calls, output_ids=ids), last
            if calls:
                yield "msg", [Message("tool", t, "result " + c.id, tool_call_id=c.id) for c in calls], None


@pytest.mark.parametrize("name", [*sorted(TEMPLATES), *HF])
@pytest.mark.parametrize("policy", POLICIES)
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(turns=conversation, k=st.integers(0, 2))
def test_rendering_is_prefix_stable(name, policy, turns, k):
    tpl = template(name)
    pol = ReasoningPolicy(policy, keep_last_k=k)
    history: list[Message] = []
    closed = 0
    for kind, msg, closes in script(tpl, turns, name in ONE_CALL, name in BARE_CALLS):
        keep = pol.kept_turns(closed)
        before = tpl.render(None, TOOLS, history, keep, False).ids
        if kind == "gen":
            prompt = tpl.render(None, TOOLS, history, keep, True).ids
            history.append(msg)
            after = tpl.render(None, TOOLS, history, keep, False).ids
            # Inside the open turn the generated sequence continues exactly.
            assert after[: len(prompt) + len(msg.output_ids)] == prompt + list(msg.output_ids)
            if closes:
                closed += 1
                kept_before, kept_now = pol.kept_turns(closed - 1), pol.kept_turns(closed)
                history = [tpl.strip_reasoning(m) if m.role == "assistant" and not kept_now(m.turn)
                           and m.reasoning else m for m in history]
                canonical = tpl.render(None, TOOLS, history, kept_now, False).ids
                dropped = [t for t in range(closed) if kept_before(t) and not kept_now(t)]
                if not dropped:
                    assert canonical == after
                else:
                    # The fork sits no earlier than the first dropped turn's output.
                    first = next(i for i, m in enumerate(history) if m.turn == dropped[0] and m.role == "assistant")
                    intact = tpl.render(None, TOOLS, history[:first], kept_now, False).ids
                    assert common_prefix(after, canonical) >= len(intact)
                    assert after[: len(intact)] == canonical[: len(intact)] == intact
        else:
            history.extend(msg)
            after = tpl.render(None, TOOLS, history, keep, False).ids
            assert after[: len(before)] == before
