"""The outbound path's memo by identity (session_runtime/weak_memo.py): a
conversation's history built, parsed, stripped, rendered and counted once per
message gives, step after step, exactly what the same bodies as a client's
plain dicts give (computed afresh); entries leave with their keys."""

from __future__ import annotations

import copy
import gc
import json
import weakref
from types import SimpleNamespace

import pytest

from session_runtime.protocols import StripOptions
from session_runtime.proxy.outbound import Outbound
from session_runtime.proxy.transcript import _CHAT_WIRE, request_body
from session_runtime.templates.base import Message, ToolCall
from session_runtime.weak_memo import WeakMemo, WireMessage


def test_an_entry_lives_as_long_as_its_key():
    memo, calls = WeakMemo(), []
    key = WireMessage(role="user", content="x")
    assert memo.get(key, lambda k: calls.append(1) or len(calls)) == 1
    assert memo.get(key, lambda k: calls.append(1) or len(calls)) == 1  # computed once
    assert len(memo) == 1
    del key
    gc.collect()
    assert len(memo) == 0
    plain = {"role": "user"}  # a client's dict cannot be weakly referenced: computed every time
    assert memo.get(plain, lambda k: 7) == 7 and len(memo) == 0


def _history(turns: int, open_chain: bool) -> list[Message]:
    out: list[Message] = []
    for t in range(turns):
        out.append(Message("user", t, content=f"question {t} " * 3))
        if t % 3 == 1:  # a tool chain inside the turn
            call = ToolCall(f"call_{t}", "calc", {"e": str(t)})
            out.append(Message("assistant", t, content="", reasoning=f"tool first {t} " * 4, tool_calls=(call,)))
            out.append(Message("tool", t, content=f"result {t}", tool_call_id=call.id))
        if t < turns - 1 or not open_chain:
            out.append(Message("assistant", t, content=f"answer {t}", reasoning=f"thinking {t} " * 5))
    return out


@pytest.mark.parametrize("protocol", ["deepseek", "openai-chat"])
@pytest.mark.parametrize("keep_tool_turns", [False, True])
def test_memoized_steps_equal_fresh_ones(protocol, keep_tool_turns):
    client = SimpleNamespace(protocol=protocol)
    memoized = Outbound(client, lambda text: len(text.split()), StripOptions(keep_tool_turns=keep_tool_turns))
    fresh = Outbound(client, lambda text: len(text.split()), StripOptions(keep_tool_turns=keep_tool_turns))
    history = _history(12, open_chain=True)
    for n in range(1, len(history) + 1):  # the conversation as it grows, step after step
        body = request_body(protocol, "system prompt", [], history[:n], {"model": "m"})
        assert all(type(m) is WireMessage for m in body["messages"][1:])
        twice = [memoized.prepare(body) for _ in range(2)]
        plain = json.loads(json.dumps(body))  # the same body as a client's dicts: nothing memoized
        expected = fresh.prepare(copy.deepcopy(plain))
        for sent, account in twice:
            assert json.dumps(sent) == json.dumps(expected[0])
            assert account == expected[1]
        assert body == plain  # the request given is never changed
    wire = weakref.ref(body["messages"][1])
    assert _CHAT_WIRE[protocol].get(history[0], lambda m: None) is wire()
    del history, body, twice
    gc.collect()
    assert wire() is None  # the stored messages gone: their wire forms too, and what came of them
    assert len(memoized._counted) == 0 and not any(map(len, memoized.protocol._memos))
