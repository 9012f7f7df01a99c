"""The step routes' lean handler (api/lean_route.py) answers as FastAPI's own.

The oracle: the same app built twice over the shared runtime, once as served
(lean) and once with FastAPI's handler on every route; each request goes to
both and the answers must be equal, status and body. The requests are the bad
bodies a client can send (not JSON, not an object, a wrong field, an unknown
field, none at all) on both step routes, for a conversation that exists and
for one that does not; and a valid step, answered by both.
"""

from __future__ import annotations

import json

import pytest
from fastapi import Depends, FastAPI, Request
from starlette.testclient import TestClient

from session_runtime.api import app as app_module
from session_runtime.api.auth import current_caller
from session_runtime.api.lean_route import LeanHandler, lean_post
from session_runtime.api.schemas import SendMessage
from tests.api.conftest import create

BAD_BODIES = [
    b'{"content": ',  # not JSON
    b"[]", b'"hello"', b"null", b"{}",
    b'{"content": 5}', b'{"content": ""}', b'{"content": "x", "bogus": 1}',
    b'{"content": "x", "max_tokens": "many"}', b'{"content": "x", "temperature": NaN}',
    b'{"results": "not a list"}', b'{"results": [{"content": "no id"}]}', b'{"results": [], "stream": 3}',
    "{\"content\": \"caf\u00e9\", \"max_tokens\": -1}".encode(),
    b'{"content": "\xe3\x81"}', b"\x91{}",  # not UTF-8
]


@pytest.fixture(scope="module")
def both(live):
    def plain_post(router, path, **kwargs):
        return router.post(path, **kwargs)

    lean = TestClient(app_module.create_app(live.runtime), base_url="http://127.0.0.1")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(app_module, "lean_post", plain_post)
        fastapi_own = TestClient(app_module.create_app(live.runtime), base_url="http://127.0.0.1")
    return lean, fastapi_own


def test_the_step_routes_are_lean_and_the_others_are_not(both):
    lean, fastapi_own = both
    served = {r.path: type(r.app) for r in lean.app.router.routes if hasattr(r, "app")}
    assert served["/v1/conversations/{cid}/messages"] is LeanHandler
    assert served["/v1/conversations/{cid}/tool_results"] is LeanHandler
    assert served["/v1/conversations"] is not LeanHandler
    assert not any(type(r.app) is LeanHandler for r in fastapi_own.app.router.routes if hasattr(r, "app"))
    assert lean.get("/openapi.json").json() == fastapi_own.get("/openapi.json").json()


@pytest.mark.parametrize("kind", ["messages", "tool_results"])
@pytest.mark.parametrize("body", BAD_BODIES, ids=range(len(BAD_BODIES)))
def test_a_bad_body_gets_fastapis_answer(client, rt, both, kind, body):
    cid = create(client, system="[lean-route] bad bodies.")
    for conversation in (cid, "no-such-conversation"):
        answers = [c.post(f"/v1/conversations/{conversation}/{kind}", content=body,
                          headers={"content-type": "application/json"}) for c in both]
        assert answers[0].status_code == answers[1].status_code >= 400, answers[0].text
        assert answers[0].json() == answers[1].json()
        assert answers[0].headers["content-type"] == answers[1].headers["content-type"]
    assert client.get(f"/v1/conversations/{cid}").json()["turns"] == []  # nothing changed


@pytest.mark.parametrize("headers", [{"content-type": "application/json"}, {}, {"content-type": "text/plain"}])
def test_an_empty_or_untyped_body_gets_fastapis_answer(client, rt, both, headers):
    cid = create(client, system="[lean-route] empty bodies.")
    typed = headers.get("content-type") == "application/json"
    for body in (b"",) if typed else (b"", b'{"content": "x"}'):  # a typed one is answered: a valid step
        answers = [c.post(f"/v1/conversations/{cid}/messages", content=body, headers=headers) for c in both]
        assert (answers[0].status_code, answers[0].json()) == (answers[1].status_code, answers[1].json())
        assert answers[0].status_code >= 400


def test_a_valid_step_is_answered_by_both(client, rt, both):
    cid = create(client, system="[lean-route] valid steps.")
    answers = [c.post(f"/v1/conversations/{cid}/messages", json={"content": "Hi", "max_tokens": 2}) for c in both]
    assert [a.status_code for a in answers] == [200, 200], answers[0].text
    assert answers[0].json().keys() == answers[1].json().keys()
    first, second = (json.loads(a.content)["accounting"] for a in answers)
    assert second["prompt_tokens"] > first["prompt_tokens"]  # one conversation, two turns
    assert len(client.get(f"/v1/conversations/{cid}").json()["turns"]) == 2


def test_a_shape_it_does_not_serve_is_refused_when_built():
    app = FastAPI()

    async def query(cid: str, n: int = 0):
        return None

    def plain(cid: str, body: SendMessage):
        return None

    async def typed_path(cid: int, body: SendMessage):
        return None

    async def two_bodies(cid: str, a: SendMessage, b: SendMessage):
        return None

    async def deeper(request: Request, caller=Depends(current_caller), who=Depends(lambda caller=Depends(current_caller): caller)):
        return None

    for endpoint, why in ((query, "query"), (plain, "async def"), (typed_path, "not a str"),
                          (two_bodies, "one pydantic model"), (deeper, "dependency")):
        with pytest.raises(ValueError, match=why):
            lean_post(app, "/x/{cid}")(endpoint)
