"""A client that disconnects mid-stream, on the protocols the other modules do
not cover (Chat, Messages' first request and the session API have theirs):
a Responses chain continued with `previous_response_id`, and a stateless
harness session's second request. The step is cancelled (it would have run
400 tokens), the conversation keeps exactly what it had, and the same request
sent again goes on from there as if the first had never come."""

from __future__ import annotations

import threading

import httpx
import pytest

MODEL = "tiny"


@pytest.fixture
def watched(rt, monkeypatch):
    """Each chat_step's outcome (the step or its error), in order."""
    real, outcomes = rt.chat_step, []
    done = threading.Semaphore(0)

    def chat_step(cid, request, **kw):
        try:
            outcomes.append(real(cid, request, **kw))
            return outcomes[-1]
        except Exception as exc:
            outcomes.append(exc)
            raise
        finally:
            done.release()

    monkeypatch.setattr(rt, "chat_step", chat_step)
    return outcomes, done


def _leave_after_first_delta(url: str, path: str, body: dict, marker: str, headers=None) -> None:
    with httpx.Client(base_url=url, timeout=60) as c:
        with c.stream("POST", path, json=body, headers=headers or {}) as r:
            assert r.status_code == 200
            next(line for line in r.iter_lines() if marker in line)


def _steps(rt, cid: str) -> int:
    return sum(len(t["steps"]) for t in rt.describe(cid)["turns"])


def test_a_responses_chain_whose_client_leaves_keeps_its_previous_turns(live, client, rt, watched):
    outcomes, done = watched
    first = client.post("/v1/responses", json={"model": MODEL, "input": "Start.", "max_output_tokens": 4}).json()
    assert done.acquire(timeout=60)
    cid = outcomes[-1].conversation_id
    before = rt.describe(cid)
    body = {"model": MODEL, "input": "Go on and on", "max_output_tokens": 400, "stream": True,
            "previous_response_id": first["id"]}
    _leave_after_first_delta(live.url, "/v1/responses", body, ".delta")  # the reasoning's or the text's
    assert done.acquire(timeout=60), "the abandoned step never stopped"
    assert type(outcomes[-1]).__name__ == "StepCancelled", outcomes[-1]
    after = rt.describe(cid)
    assert (after["trace"], _steps(rt, cid)) == (before["trace"], len(before["turns"][0]["steps"]))
    again = client.post("/v1/responses", json={**body, "stream": False, "max_output_tokens": 4})
    assert again.status_code == 200 and len(rt.describe(cid)["turns"]) == 2
    rt.check_integrity()


def test_a_stateless_session_whose_client_leaves_mid_turn_goes_on_as_one_conversation(live, client, rt, watched):
    """A harness's second request (the whole history again) is abandoned
    mid-stream; its conversation keeps its first turn only, and the harness's
    retry of that request becomes the second turn of the same conversation."""
    outcomes, done = watched
    history = [{"role": "user", "content": "First question."}]
    r = client.post("/v1/messages", json={"model": MODEL, "max_tokens": 4, "messages": history})
    assert r.status_code == 200 and done.acquire(timeout=60)
    cid = r.headers["x-session-runtime-conversation"]
    history += [{"role": "assistant", "content": r.json()["content"]},
                {"role": "user", "content": "Go on and on"}]
    before = rt.describe(cid)
    body = {"model": MODEL, "max_tokens": 400, "stream": True, "messages": history}
    _leave_after_first_delta(live.url, "/v1/messages", body, "content_block_delta")
    assert done.acquire(timeout=60), "the abandoned step never stopped"
    assert type(outcomes[-1]).__name__ == "StepCancelled", outcomes[-1]
    assert (rt.describe(cid)["trace"], len(rt.describe(cid)["turns"])) == (before["trace"], 1)
    again = client.post("/v1/messages", json={**body, "stream": False, "max_tokens": 4})
    assert again.status_code == 200 and again.headers["x-session-runtime-conversation"] == cid
    assert len(rt.describe(cid)["turns"]) == 2
    rt.check_integrity()
