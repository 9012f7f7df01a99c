"""Held chains never wedge SGLang's scheduler (radix_ext/sglang/pressure.py),
on its real server (the session's shared one: pool 2048, page 16): with the
pool held by conversations waiting for tools under offload `never`, a new
conversation whose prompt needs most of the pool runs; the waiting
conversations then go on, their next steps prefilling what was released
(counted as `evicted`); nothing is lost and the tree's integrity holds."""

from __future__ import annotations

from session_runtime.backends.base import Cancellation
from tests.conftest import SGLANG_POOL

CALL = {"reasoning": "I need the tool for this. " * 4, "tool_calls": [{"name": "lookup", "arguments": {"q": 1}}]}
ANSWER = {"reasoning": "Now I know.", "content": "Done."}


def test_conversations_waiting_for_tools_make_room_for_a_request_that_needs_it(sglang_rt):
    rt = sglang_rt
    waiting = []
    for i in range(4):  # about 330 tokens each, held while their tools run
        cid = rt.create_conversation(system=f"Agent {i} of the pressure test. " + "Context word. " * 100,
                                     policy="drop", offload="never")
        step = rt.send_message(cid, "Look it up.", forced=CALL)
        waiting.append((cid, step.tool_calls[0]["id"]))
    held = sum(rt.chains().get(cid, 0) for cid, _ in waiting)
    big = rt.create_conversation(system="A long document. " + "Paragraph text here. " * 300, policy="drop")
    prompt = rt.prompt_tokens(big, _user("Summarize it."))
    assert held + prompt > SGLANG_POOL  # it fits only if waiting chains give way
    step = rt.send_message(big, "Summarize it.", max_tokens=4, cancel=Cancellation(deadline_s=120))
    assert step.accounting.prompt_tokens == prompt
    for cid, call in waiting:  # every waiting conversation goes on where it was
        nxt = rt.send_tool_results(cid, [{"tool_call_id": call, "content": "42"}], forced=ANSWER,
                                   cancel=Cancellation(deadline_s=60))
        assert nxt.turn == 0 and nxt.step == 1
        assert sum(r["tokens"] for r in nxt.accounting.uncached) == nxt.accounting.uncached_prefill_tokens
    evicted = [reason for cid, _ in waiting for reason in rt.get(cid).turns[0].steps[1].uncached
               if reason["reason"] == "evicted"]
    assert evicted, "no waiting chain was relieved"
    rt.check_integrity()


def _user(content: str):
    from session_runtime.continuation import ChatInput

    return ChatInput(system=None, system_given=False, tools=None, history=[], new=[{"role": "user", "content": content}])
