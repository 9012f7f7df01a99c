"""One request model for the three chat routes: `/v1/chat/completions`,
`/v1/messages` (Anthropic Messages) and `/v1/responses` (OpenAI Responses)
refuse the same bad input with the same status, never 500, each in its own
protocol's error shape; every POST body must be JSON (415) and shallow (at
most MAX_DEPTH levels); the served model is checked on all three; what the
server cannot honour (a hosted tool choice) is refused rather than dropped by the conversion (/v1/messages honours
tool_choice none by leaving the tools out of the prompt; what it constrains:
test_constrained_routes.py).

Over the shared server of conftest.py; the edge's middlewares under other
settings (keys, a small body limit, allowed hosts) through TestClient apps
over its runtime, so no other Runtime is built.
"""

from __future__ import annotations

import json
from typing import Iterator, Optional

import anthropic
import httpx
import pytest
from fastapi.testclient import TestClient

from session_runtime.api.app import create_app
from session_runtime.api.content_type import MAX_DEPTH, nesting_depth
from session_runtime.api.errors import ApiError, error_response
from session_runtime.api.settings import ApiSettings, allowed_hosts, load_credentials

from tests.api.conftest import create

MODEL = "tiny"
USER = {"role": "user", "content": "Hi"}
PATHS = {"chat": "/v1/chat/completions", "messages": "/v1/messages", "responses": "/v1/responses"}
VALID = {
    "chat": {"model": MODEL, "max_tokens": 2, "messages": [USER]},
    "messages": {"model": MODEL, "max_tokens": 2, "messages": [USER]},
    "responses": {"model": MODEL, "max_output_tokens": 2, "input": "Hi"},
}
DEEP = 10_000
DEEP_MESSAGE = f"the request body nests arrays and objects {DEEP + 1} levels deep; this server reads at most 64"


def openai(message: str, param: Optional[str] = None, code: Optional[str] = None,
           kind: str = "invalid_request_error") -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def anthropic_error(message: str, kind: str = "invalid_request_error") -> dict:
    return {"type": "error", "error": {"type": kind, "message": message}}


def session(message: str, kind: str) -> dict:
    return {"error": {"type": kind, "message": message}}


def post_raw(client, path: str, body: bytes, content_type: Optional[str] = "application/json") -> httpx.Response:
    headers = {} if content_type is None else {"content-type": content_type}
    return client.post(path, content=body, headers=headers)


def assert_error(r: httpx.Response, status: int, body: dict) -> None:
    """The status, the whole body, JSON, and no retry of a client error."""
    assert (r.status_code, r.json()) == (status, body), r.text
    assert r.headers["content-type"] == "application/json"
    if status < 500:
        assert r.headers["x-should-retry"] == "false"


# ----- the bad-input table × the three routes ----------------------------------------------------

# Each row: what it sets per route (None: the body is built by hand), then
# what each route answers: (status, body).
BAD = {
    "max_tokens -1": (
        {"chat": {"max_tokens": -1}, "messages": {"max_tokens": -1}, "responses": {"max_output_tokens": -1}},
        {"chat": (400, openai("body.max_tokens: Input should be greater than or equal to 0", "max_tokens")),
         "messages": (400, anthropic_error("max_tokens: Input should be greater than or equal to 0")),
         "responses": (400, openai("max_output_tokens: Input should be greater than or equal to 0",
                                   "max_output_tokens"))}),
    "temperature -1": (
        {route: {"temperature": -1} for route in PATHS},
        {"chat": (400, openai("body.temperature: Input should be greater than or equal to 0", "temperature")),
         "messages": (400, anthropic_error("temperature: Input should be greater than or equal to 0")),
         "responses": (400, openai("temperature: Input should be greater than or equal to 0", "temperature"))}),
    "top_p 0": (
        {route: {"top_p": 0} for route in PATHS},
        {"chat": (400, openai("body.top_p: Input should be greater than 0", "top_p")),
         "messages": (400, anthropic_error("top_p: Input should be greater than 0")),
         "responses": (400, openai("top_p: Input should be greater than 0", "top_p"))}),
    "no messages": (
        {"chat": {"messages": []}, "messages": {"messages": []}, "responses": {"input": []}},
        {"chat": (400, openai("body.messages: List should have at least 1 item after validation, not 0", "messages")),
         "messages": (400, anthropic_error("messages: at least one message is required")),
         "responses": (400, openai("input: at least one input item is required", "input"))}),
    "nested 10,000 deep": (
        None,
        {"chat": (400, openai(DEEP_MESSAGE)),
         "messages": (400, anthropic_error(DEEP_MESSAGE)),
         "responses": (400, openai(DEEP_MESSAGE))}),
}


def deep_body(valid: dict) -> bytes:
    """`valid` with one more field nested DEEP arrays down (json.dumps cannot write it)."""
    return (json.dumps(valid)[:-1] + ', "metadata": ' + "[" * DEEP + "]" * DEEP + "}").encode()


@pytest.mark.parametrize("route", list(PATHS))
@pytest.mark.parametrize("row", list(BAD))
def test_bad_input_is_400_in_each_routes_shape(client, rt, row, route):
    patches, answers = BAD[row]
    body = deep_body(VALID[route]) if patches is None else json.dumps({**VALID[route], **patches[route]}).encode()
    assert_error(post_raw(client, PATHS[route], body), *answers[route])


@pytest.mark.parametrize("route", list(PATHS))
def test_the_tables_valid_bodies_are_answered(client, rt, route):
    """The rows above differ from an answered body only in their field; a
    charset parameter on the JSON type is fine."""
    r = post_raw(client, PATHS[route], json.dumps(VALID[route]).encode(), "application/json; charset=utf-8")
    assert r.status_code == 200, r.text
    assert r.json()["model"] == MODEL


# ----- JSON only: 415 ---------------------------------------------------------------------------


def test_a_body_that_is_not_json_typed_is_415_in_each_routes_shape(client, rt):
    cid = create(client, system="[request-model] 415 changes nothing.")
    before = client.get(f"/v1/conversations/{cid}").json()
    routes = {**PATHS, "conversations": "/v1/conversations", "message": f"/v1/conversations/{cid}/messages"}
    bodies = {**VALID, "conversations": {"system": "x"}, "message": {"content": "Hi"}}
    for content_type, said in (("text/plain", "Content-Type 'text/plain'"),
                               ("application/x-www-form-urlencoded",
                                "Content-Type 'application/x-www-form-urlencoded'"),
                               ("multipart/form-data; boundary=x", "Content-Type 'multipart/form-data; boundary=x'"),
                               (None, "no Content-Type")):
        message = f"the request body must be JSON (Content-Type: application/json); it came with {said}"
        want = {"chat": openai(message, code="unsupported_media_type"),
                "responses": openai(message, code="unsupported_media_type"),
                "messages": anthropic_error(message),
                "conversations": session(message, "unsupported_media_type"),
                "message": session(message, "unsupported_media_type")}
        for route, path in routes.items():
            assert_error(post_raw(client, path, json.dumps(bodies[route]).encode(), content_type), 415, want[route])
    assert client.get(f"/v1/conversations/{cid}").json() == before


def test_a_chunked_body_is_checked_too(client, rt):
    """No Content-Length: the body is read (within the body limit) to see it is not empty."""
    def chunks() -> Iterator[bytes]:
        yield json.dumps(VALID["messages"]).encode()

    r = client.post("/v1/messages", content=chunks(), headers={"content-type": "text/plain"})
    assert_error(r, 415, anthropic_error("the request body must be JSON (Content-Type: application/json); it came "
                                         "with Content-Type 'text/plain'"))
    r = client.post("/v1/messages", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 200, r.text


def test_a_request_without_a_body_needs_no_type(client, rt):
    """Routes that read no body (the drain, DELETE) are sent without one; an
    empty body is no body, whatever its type says."""
    for content_type in (None, "text/plain"):
        headers = {} if content_type is None else {"content-type": content_type}
        r = client.post("/admin/workers/w1/drain", headers=headers)
        assert_error(r, 404, session("no SGLang worker 'w1' (many workers: see /health)", "not_found"))
        # Read as the route reads it: no JSON at all (400), not a 415.
        assert_error(client.post("/v1/messages", headers=headers), 400, anthropic_error(
            "the body is not JSON: Expecting value: line 1 column 1 (char 0)"))
    cid = create(client, system="[request-model] Deleted without a body.")
    assert client.delete(f"/v1/conversations/{cid}").json() == {"id": cid, "deleted": True}
    # A body on a route that reads none is still a body: JSON only.
    r = post_raw(client, "/admin/workers/w1/drain", b"x", "text/plain")
    assert r.status_code == 415 and r.json()["error"]["type"] == "unsupported_media_type"


# ----- nesting depth ----------------------------------------------------------------------------


@pytest.mark.parametrize("text, depth", [
    ('""', 0), ("3", 0), ("[]", 1), ('{"a": [{"b": []}]}', 4),
    ('{"a": "[[[{{{"}', 1),  # brackets in a string
    ('{"a": "\\"[[[", "b": "]]]\\\\"}', 1),  # an escaped quote, an escaped backslash before the closing quote
    ('{"a": "\\\\\\"[[", "b": [[1]]}', 3),  # an escaped backslash then an escaped quote
    ("[" + "[[]]," * 5 + "[]]", 3), ("[" * 100 + "]" * 100, 100),
])
def test_nesting_depth(text, depth):
    assert nesting_depth(text.encode()) == depth
    if depth:
        json.loads(text)  # the cases are JSON


def test_the_depth_limit(client, rt):
    """MAX_DEPTH levels are read (an extra field the chat route ignores); one
    more is refused before any parser sees the body: in the session API's
    shape its 422 for bad input."""
    assert MAX_DEPTH == 64

    def body(levels: int) -> bytes:  # the top-level object is the first level
        return (json.dumps(VALID["chat"])[:-1] + ', "extra": ' + "[" * (levels - 1) + "]" * (levels - 1) + "}").encode()

    assert post_raw(client, PATHS["chat"], body(MAX_DEPTH)).status_code == 200
    message = f"the request body nests arrays and objects {MAX_DEPTH + 1} levels deep; this server reads at most 64"
    assert_error(post_raw(client, PATHS["chat"], body(MAX_DEPTH + 1)), 400, openai(message))
    deep = b'{"system": "x", "tools": ' + b"[" * 65 + b"]" * 65 + b"}"
    assert_error(post_raw(client, "/v1/conversations", deep), 422, session(
        "the request body nests arrays and objects 66 levels deep; this server reads at most 64", "invalid_request"))


# ----- the served model -------------------------------------------------------------------------


def test_another_model_is_404_on_each_route(client, rt):
    message = "the model 'gpt-x' does not exist: this server serves 'tiny' (GET /v1/models)"
    for route in PATHS:
        r = client.post(PATHS[route], json={**VALID[route], "model": "gpt-x"})
        want = anthropic_error(message, "not_found_error") if route == "messages" else openai(
            message, "model", "model_not_found")
        assert_error(r, 404, want)
    assert_error(client.post("/v1/messages", json={**VALID["messages"], "model": 7}), 400,
                 anthropic_error("model: expected a string"))
    # No model at all: the served one, as on the chat route.
    for route in PATHS:
        body = {k: v for k, v in VALID[route].items() if k != "model"}
        assert client.post(PATHS[route], json=body).status_code == 200


@pytest.mark.parametrize("protocol, path, other", [("anthropic", "/v1/messages", "/v1/responses"),
                                                   ("openai-responses", "/v1/responses", "/v1/messages")])
def test_answering_as_the_provider_takes_its_model_names(live, protocol, path, other):
    """`--validate PROTOCOL`: the route of that protocol takes any model name
    (the provider's), as the chat route does under `--validate deepseek`; the
    other route still checks it."""
    route = {"/v1/messages": "messages", "/v1/responses": "responses"}
    with TestClient(create_app(live.runtime, ApiSettings(validate=protocol))) as c:
        r = c.post(path, json={**VALID[route[path]], "model": "provider-model"})
        assert r.status_code == 200 and r.json()["model"] == MODEL, r.text
        assert c.post(other, json={**VALID[route[other]], "model": "provider-model"}).status_code == 404
    live.runtime.check_integrity()


# ----- what the chat route cannot honour ---------------------------------------------------------


@pytest.mark.parametrize("route, field, value, message", [
    ("responses", "tool_choice", {"type": "mcp", "server_label": "x"},
     'tool_choice {"type": "mcp", "server_label": "x"} is not supported: expected "auto", "none", "required" or a '
     'function tool'),
])
def test_what_the_chat_route_refuses_is_refused_not_dropped(client, rt, route, field, value, message):
    """The constraints this server honours are tested in test_constrained_routes.py; these it cannot."""
    tools = {"messages": [{"name": "get_weather", "description": "Weather.", "input_schema": {"type": "object"}}],
             "responses": [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}]}[route]
    r = client.post(PATHS[route], json={**VALID[route], "tools": tools, field: value})
    param = "text.format" if field == "text" else field
    assert_error(r, 400, anthropic_error(message) if route == "messages" else openai(message, param))


@pytest.mark.parametrize("route, fields", [
    ("messages", {"stop_sequences": []}), ("messages", {"stop_sequences": None}),
    ("messages", {"tool_choice": {"type": "auto"}}), ("messages", {"tool_choice": {"type": "none"}}),
    # none with tools: the tools are left out of the prompt (test_messages_route.py::test_tool_choice)
    ("messages", {"tool_choice": {"type": "none"}, "tools": [{"name": "f", "input_schema": {"type": "object"}}]}),
    ("responses", {"tool_choice": "auto"}), ("responses", {"tool_choice": "none"}),
    ("responses", {"text": {"format": {"type": "text"}}}),
])
def test_their_defaults_are_answered(client, rt, route, fields):
    """The default values, and none without tools, as the chat route takes them."""
    assert client.post(PATHS[route], json={**VALID[route], **fields}).status_code == 200


# ----- Anthropic's error shape from every layer ---------------------------------------------------


def test_the_anthropic_sdk_gets_its_own_errors(live, rt):
    with anthropic.Anthropic(base_url=live.url, api_key="x", max_retries=0) as sdk:
        reply = sdk.messages.create(model=MODEL, max_tokens=2, messages=[USER])
        assert (reply.type, reply.role, reply.model) == ("message", "assistant", MODEL)
        with pytest.raises(anthropic.BadRequestError) as bad:
            sdk.messages.create(model=MODEL, max_tokens=-1, messages=[USER])
        body = anthropic_error("max_tokens: Input should be greater than or equal to 0")
        assert (bad.value.status_code, bad.value.body, bad.value.response.json()) == (400, body, body)
        assert bad.value.type == "invalid_request_error"
        with pytest.raises(anthropic.NotFoundError) as missing:
            sdk.messages.create(model="claude-sonnet-4-5", max_tokens=2, messages=[USER])
        assert missing.value.body == anthropic_error(
            "the model 'claude-sonnet-4-5' does not exist: this server serves 'tiny' (GET /v1/models)",
            "not_found_error")


def test_routing_errors_and_a_500_in_anthropics_shape(client, rt, monkeypatch):
    r = client.get("/v1/messages")
    assert_error(r, 405, anthropic_error("GET is not allowed on /v1/messages (allowed: POST)"))
    assert r.headers["allow"] == "POST"
    assert_error(client.post("/v1/messages/batches", json={}), 404,
                 anthropic_error("no route POST /v1/messages/batches", "not_found_error"))

    def broken(*args, **kwargs):
        raise RuntimeError("secret internals")

    monkeypatch.setattr(rt.backend, "step", broken)
    # A body not sent before: the same body again would be a retry, its step's answer replayed without a step.
    body = {**VALID["messages"], "messages": [{"role": "user", "content": "A 500, please."}]}
    r = client.post("/v1/messages", json=body)
    assert (r.status_code, r.json()) == (500, anthropic_error("internal error", "api_error"))


def test_the_middlewares_answer_in_anthropics_shape(live):
    """401 (Authenticate), 413 (BodyLimit) and a foreign Host (CheckHost)
    answer before any route, each in the shape of the route asked for."""
    keyed = ApiSettings(credentials=load_credentials("k"), max_body_bytes=300)
    with TestClient(create_app(live.runtime, keyed)) as c:
        no_key = anthropic_error("no API key: send the header 'Authorization: Bearer KEY' (or 'x-api-key: KEY')", "authentication_error")
        assert_error(c.post("/v1/messages", json=VALID["messages"]), 401, no_key)
        # The key is checked first: a body the server would refuse gets 401 too.
        assert_error(c.post("/v1/messages", content=b"x", headers={"content-type": "text/plain"}), 401, no_key)
        assert_error(c.post("/v1/messages", json=VALID["messages"], headers={"authorization": "Bearer no"}), 401,
                     anthropic_error("the API key is not valid", "authentication_error"))
        r = c.post("/v1/messages", json={**VALID["messages"], "system": "x" * 300},
                   headers={"authorization": "Bearer k"})
        assert_error(r, 413, anthropic_error("the request body is over this server's limit of 300 bytes "
                                             "(--max-body-bytes)", "request_too_large"))
        r = c.post("/v1/responses", json={**VALID["responses"], "instructions": "x" * 300},
                   headers={"authorization": "Bearer k"})
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    with TestClient(create_app(live.runtime, ApiSettings(allowed_hosts=allowed_hosts("127.0.0.1")))) as c:
        r = c.post("/v1/messages", json=VALID["messages"], headers={"host": "rebound.example"})
        assert_error(r, 400, anthropic_error(
            "the Host header 'rebound.example' is not one this server answers to (127.0.0.1, [::1], localhost; "
            "see --allowed-hosts)"))


@pytest.mark.parametrize("status, kind, answer", [
    (400, "invalid_host", (400, "invalid_request_error")),
    (401, "unauthorized", (401, "authentication_error")),
    (403, "forbidden", (403, "permission_error")),
    (404, "not_found", (404, "not_found_error")),
    (405, "method_not_allowed", (405, "invalid_request_error")),  # other 4xx keep their status
    (409, "conflict", (409, "invalid_request_error")),
    (413, "request_too_large", (413, "request_too_large")),
    (413, "context_too_long", (400, "invalid_request_error")),  # Anthropic's "prompt is too long"
    (415, "unsupported_media_type", (415, "invalid_request_error")),
    (422, "invalid_request", (400, "invalid_request_error")),
    (429, "conversation_limit", (429, "rate_limit_error")),
    (500, "internal", (500, "api_error")),
    (503, "backend_unavailable", (529, "overloaded_error")),
    (507, "pool_exhausted", (529, "overloaded_error")),
])
def test_anthropic_status_and_type_of_each_error(status, kind, answer):
    response = error_response(ApiError(status, kind, "why"), "/v1/messages")
    assert (response.status_code, json.loads(response.body)) == (answer[0], anthropic_error("why", answer[1]))
