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

from fastapi.routing import APIRoute

from session_runtime.api import app as app_module
from session_runtime.api.auth import current_caller
from session_runtime.api.lean_route import LeanHandler, LeanRoute, lean_post
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
    """The app as served, and the same app with FastAPI's own handler on every route."""
    lean = TestClient(app_module.create_app(live.runtime), base_url="http://127.0.0.1")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(LeanRoute, "get_route_handler", APIRoute.get_route_handler)
        fastapi_own = TestClient(app_module.create_app(live.runtime), base_url="http://127.0.0.1")
    return lean, fastapi_own


def routes(router) -> list:
    """Every route of a router, included routers' too (FastAPI 0.165 keeps them as `_IncludedRouter`)."""
    found = []
    for r in router.routes:
        inner = getattr(r, "original_router", None)
        found += routes(inner) if inner is not None else [r]
    return found


def test_the_step_routes_are_lean_and_the_others_are_not(both):
    lean = {r.path: r.lean for r in routes(both[0].app.router) if isinstance(r, LeanRoute)}
    assert lean == {"/v1/conversations/{cid}/messages": True, "/v1/conversations/{cid}/tool_results": True,
                    "/v1/chat/completions": True, "/v1/models": False, "/v1/models/{model:path}": False,
                    "/v1/messages": True, "/v1/messages/count_tokens": True, "/v1/responses": True,
                    "/v1/responses/{rid}": False, "/v1beta/models/{target:path}": True,
                    "/v1/models/{target:path}": True}
    assert both[0].get("/openapi.json").json() == both[1].get("/openapi.json").json()


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


def test_a_shape_it_does_not_serve_gets_fastapis_handler():
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
                          (two_bodies, "embedded body"), (deeper, "dependency")):
        lean_post(app, "/x/{cid}")(endpoint)  # served by FastAPI's own handler
        route = app.router.routes[-1]
        assert isinstance(route, LeanRoute) and not route.lean
        with pytest.raises(ValueError, match=why):
            LeanHandler.of(route)


PROTOCOL_BAD = [b'{"messages": ', b"[]", b"{}", b'{"messages": "x"}', b'{"messages": [], "max_tokens": "many"}',
                b'{"model": 5, "messages": [{"role": "user", "content": "hi"}]}', b"\x91{}"]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages", "/v1/messages/count_tokens",
                                  "/v1/responses"])
@pytest.mark.parametrize("body", PROTOCOL_BAD, ids=range(len(PROTOCOL_BAD)))
def test_the_protocol_routes_answer_a_bad_body_as_fastapi(rt, both, path, body):
    answers = [c.post(path, content=body, headers={"content-type": "application/json"}) for c in both]
    assert answers[0].status_code == answers[1].status_code >= 400, answers[0].text
    assert answers[0].json() == answers[1].json()


def shape(value):
    """A JSON value's structure: its keys and types, not its ids and texts."""
    if isinstance(value, dict):
        return {k: shape(v) for k, v in value.items()}
    if isinstance(value, list):
        return [shape(v) for v in value]
    return type(value).__name__


def test_a_chat_completion_is_answered_alike(rt, both):
    body = {"messages": [{"role": "user", "content": "[lean-route] hello"}], "max_tokens": 2}
    answers = [c.post("/v1/chat/completions", json=body) for c in both]
    assert [a.status_code for a in answers] == [200, 200], answers[0].text
    assert answers[0].headers["content-type"] == answers[1].headers["content-type"]
    assert shape(answers[0].json()) == shape(answers[1].json())


def test_fastapis_dependency_solver_serves_only_the_routes_that_are_not_lean(live, monkeypatch):
    """Served, not only shaped: on a lean route (an included router's too) FastAPI's solver never runs."""
    import fastapi.routing

    solved = []
    solve = fastapi.routing.solve_dependencies

    async def counted(*args, **kwargs):
        solved.append(kwargs["request"].url.path)
        return await solve(*args, **kwargs)

    monkeypatch.setattr(fastapi.routing, "solve_dependencies", counted)
    client = TestClient(app_module.create_app(live.runtime), base_url="http://127.0.0.1")
    for path in ("/v1/chat/completions", "/v1/messages", "/v1/responses", "/v1/conversations/none/messages",
                 "/v1/conversations/none/tool_results"):
        assert client.post(path, content=b"{}", headers={"content-type": "application/json"}).status_code >= 400
    assert solved == []
    assert client.post("/v1/conversations", json={"system": "[lean-route] solver"}).status_code == 201
    assert solved == ["/v1/conversations"]
