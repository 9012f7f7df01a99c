"""A conversation's outbound request built past its last one
(session_runtime/proxy/prefix.py): step after step, with histories that grow,
fork, shrink and change their system prompt, the body and the stripper's
account equal what a fresh `Outbound` makes of the same body as a client's
plain dicts; and a step works only on the messages past the last request."""

from __future__ import annotations

import copy
import json
import random
from types import SimpleNamespace

import pytest

from session_runtime.protocols import StripOptions
from session_runtime.proxy.outbound import Outbound
from session_runtime.proxy.prefix import OutboundPrefix, PrefixMap
from session_runtime.proxy.transcript import request_body
from session_runtime.templates.base import Message, ToolCall


def test_a_prefix_map_recomputes_past_the_shared_prefix_or_start():
    seen: list[int] = []
    pm, xs = PrefixMap(), [object() for _ in range(6)]

    def f(i, x):
        seen.append(i)
        return i

    assert pm.map(xs[:4], f) == [0, 1, 2, 3] and seen == [0, 1, 2, 3]
    seen.clear()
    assert pm.map(xs, f, tag="t") == list(range(6)) and seen == [4, 5] and pm.tag == "t"
    seen.clear()
    assert pm.map(xs, f, start=3) == list(range(6)) and seen == [3, 4, 5]
    seen.clear()
    other = [*xs[:2], object(), *xs[3:]]
    assert pm.map(other, f) == list(range(6)) and seen == [2, 3, 4, 5]  # parts at 2: recomputed from there
    seen.clear()
    assert pm.map(other[:3], f) == [0, 1, 2] and seen == []  # shorter: nothing to compute

    def fails(i, x):
        raise ValueError(i)

    with pytest.raises(ValueError):
        pm.map(xs, fails)
    assert pm.map(other[:3], f) == [0, 1, 2] and seen == []  # a failed call left the last state


def _reply(rng: random.Random, t: int, k: int, protocol: str) -> Message:
    if rng.random() < 0.35:
        calls = tuple(ToolCall(f"call_{t}_{k}_{j}", "calc", {"e": f"{t}+{k}+{j}"}) for j in range(rng.choice([1, 2])))
        m = Message("assistant", t, content=rng.choice(["", "let me check"]),
                    reasoning=rng.choice(["", f"need a tool {t} " * 3]), tool_calls=calls)
    elif protocol == "anthropic" and rng.random() < 0.05:
        m = Message("assistant", t, content="")  # an empty answer: no message on Anthropic's wire
    else:
        m = Message("assistant", t, content=f"answer {t}.{k}", reasoning=rng.choice(["", f"thinking {t} " * 4]))
    if protocol == "anthropic" and rng.random() < 0.7:  # the provider's own, with signed thinking
        blocks = [{"type": "thinking", "thinking": m.reasoning, "signature": f"sig{t}.{k}"}] if m.reasoning else []
        blocks += [{"type": "text", "text": m.content}] if m.content else []
        blocks += [{"type": "tool_use", "id": c.id, "name": c.name, "input": c.arguments} for c in m.tool_calls]
        wire = json.dumps({"protocol": "anthropic", "message": {"role": "assistant", "content": blocks}})
        m = Message("assistant", t, content=m.content, reasoning=m.reasoning, tool_calls=m.tool_calls, wire=wire)
    return m


def _steps(rng: random.Random, n: int, protocol: str = "deepseek"):
    """(system, messages) per step of a conversation that grows (tool results
    one at a time), and now and then forks (an earlier message replaced),
    shrinks (a client's history with fewer turns), ends on an assistant (a
    strict shape) or changes its system."""
    history: list[Message] = []
    system = "system prompt ünïcode \u2028"
    t = 0
    for _ in range(n):
        roll = rng.random()
        if roll < 0.08 and len(history) > 3:
            i = rng.randrange(len(history))
            history[i] = Message(history[i].role, history[i].turn, content="rewritten " + history[i].content,
                                 reasoning=history[i].reasoning, tool_calls=history[i].tool_calls,
                                 tool_call_id=history[i].tool_call_id)
        elif roll < 0.14 and len(history) > 3:
            history = history[:rng.randrange(1, len(history))]
        elif roll < 0.18:
            system = rng.choice(["system prompt", "another system prompt", ""])
        asked = next((m for m in reversed(history) if m.role != "tool"), None)
        answered = len(history) - 1 - history.index(asked) if asked is not None else 0
        if asked is not None and asked.role == "assistant" and answered < len(asked.tool_calls):
            call = asked.tool_calls[answered]
            history.append(Message("tool", asked.turn, content=f"result {t}", tool_call_id=call.id))
            yield system, list(history)
            if answered + 1 < len(asked.tool_calls):
                continue  # the next result comes with the next step
        else:
            t += 1
            history.append(Message("user", t, content=f"question {t}"))
            yield system, list(history)
        history.append(_reply(rng, t, len(history), protocol))
        if rng.random() < 0.05:
            yield system, list(history)  # the last message is an assistant: DeepSeek's strict shape


@pytest.mark.parametrize("protocol", ["deepseek", "openai-chat", "anthropic"])
@pytest.mark.parametrize("keep_tool_turns", [False, True])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_steps_built_past_the_last_request_equal_fresh_ones(protocol, keep_tool_turns, seed):
    client = SimpleNamespace(protocol=protocol)
    count = lambda text: len(text.split())  # noqa: E731
    options = StripOptions(keep_tool_turns=keep_tool_turns)
    incremental, fresh = Outbound(client, count, options, model="m2"), Outbound(client, count, options, model="m2")
    prefix = OutboundPrefix()
    stripped = 0
    for system, history in _steps(random.Random(seed), 120, protocol):
        body = request_body(protocol, system, [], history, {"model": "m", "max_tokens": 8}, prefix)
        plain = json.loads(json.dumps(body))
        assert plain == request_body(protocol, system, [], history, {"model": "m", "max_tokens": 8})
        sent, account, encoded = incremental._prepare(body, prefix)
        expected_sent, expected_account = fresh.prepare(copy.deepcopy(plain))
        assert json.dumps(sent) == json.dumps(expected_sent)
        assert account == expected_account
        stripped += account.messages_stripped
        if encoded is not None:  # written from each message's own JSON: the same bytes as the whole body's
            assert encoded == json.dumps(expected_sent, ensure_ascii=False).encode()
        assert body == plain  # the request given is never changed
    assert stripped > 0  # the histories had reasoning to strip

@pytest.mark.parametrize("protocol", ["deepseek", "anthropic"])
def test_a_step_works_only_past_the_last_user_message(protocol):
    client = SimpleNamespace(protocol=protocol)
    outbound, prefix = Outbound(client, lambda text: len(text.split()), StripOptions()), OutboundPrefix()
    figured: list[int] = []
    real = outbound._figures
    outbound._figures = lambda m, history: figured.append(1) or real(m, history)
    history: list[Message] = []
    for t in range(200):
        history.append(Message("user", t, content=f"question {t}"))
        figured.clear()
        outbound.prepare(request_body(protocol, "system", [], history, {"model": "m"}, prefix), prefix)
        assert len(figured) <= 3  # the last turn's answer (stripped now), the new question
        history.append(Message("assistant", t, content=f"answer {t}", reasoning="thinking " * 5))
    if protocol == "anthropic":
        assert len(prefix.joined[2]) == len(history) - 1  # one wire message each, up to the last request
    else:
        assert len(prefix.wire.map(history, lambda i, m: None)) == len(history)
