"""Conventions at the edge: every error, FastAPI's own 404 and 405 included,
in the shape of its route's family (the session API's `{error: {type,
message}}`, OpenAI's `{error: {message, type, param, code}}` on the other
`/v1/...` routes); a 500 carries no exception text; `GET /v1/models`,
`GET /v1/models/{id}` and `GET /version`.
"""

from __future__ import annotations

import importlib.metadata
import logging

import openai
import pytest
from openai import OpenAI

from tests.api.conftest import create, error_of, openai_error_of


def test_models_and_version(client, live):
    listed = client.get("/v1/models").json()
    assert listed["object"] == "list" and [m["id"] for m in listed["data"]] == ["tiny"]
    card = listed["data"][0]
    assert (card["object"], card["owned_by"], type(card["created"])) == ("model", "session-runtime", int)
    assert client.get("/v1/models/tiny").json() == card
    message = openai_error_of(client.get("/v1/models/gpt-4o"), 404, "invalid_request_error", "model_not_found", "model")
    assert message == "the model 'gpt-4o' does not exist: this server serves 'tiny' (GET /v1/models)"
    with OpenAI(base_url=f"{live.url}/v1", api_key="x", max_retries=0) as oai:
        assert [m.id for m in oai.models.list()] == ["tiny"]
        with pytest.raises(openai.NotFoundError):
            oai.models.retrieve("gpt-4o")
    assert client.get("/version").json() == {"version": importlib.metadata.version("session-runtime")}


def test_unknown_routes_and_methods_in_the_session_shape(client):
    assert error_of(client.get("/nowhere"), 404, "not_found") == "no route GET /nowhere"
    assert error_of(client.get("/v1/conversations/x/nowhere"), 404, "not_found") == (
        "no route GET /v1/conversations/x/nowhere")
    r = client.put("/v1/conversations")
    assert error_of(r, 405, "method_not_allowed") == "PUT is not allowed on /v1/conversations (allowed: GET, POST)"
    assert r.headers["allow"] == "GET, POST"
    assert error_of(client.post("/health"), 405, "method_not_allowed").startswith("POST is not allowed on /health")
    # A malformed body keeps the session API's documented 422.
    r = client.post("/v1/conversations", content=b"{not json", headers={"content-type": "application/json"})
    assert error_of(r, 422, "validation_error").startswith("body.1: JSON decode error")


def test_unknown_routes_methods_and_bodies_in_openai_shape(client):
    assert openai_error_of(client.get("/v1/nowhere"), 404, "invalid_request_error", "not_found") == (
        "no route GET /v1/nowhere")
    r = client.get("/v1/chat/completions")
    assert openai_error_of(r, 405, "invalid_request_error", "method_not_allowed") == (
        "GET is not allowed on /v1/chat/completions (allowed: POST)")
    r = client.post("/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert openai_error_of(r, 400, "invalid_request_error", None, "1").startswith("body.1: JSON decode error")
    r = client.post("/v1/chat/completions", json={"messages": "hi"})
    assert openai_error_of(r, 400, "invalid_request_error", None, "messages").startswith("body.messages:")
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "n": 2})
    assert openai_error_of(r, 400, "invalid_request_error", None, "n").startswith("body.n:")


def test_a_500_says_internal_error_and_logs_the_rest(client, rt, monkeypatch, caplog):
    """An engine bug: the client learns nothing of its text; the log has it."""
    def broken(*args, **kwargs):
        raise RuntimeError("secret internals: /srv/keys.json")

    cid = create(client, system="[conventions] A broken engine.")
    monkeypatch.setattr(rt.backend, "step", broken)
    with caplog.at_level(logging.ERROR, logger="session_runtime"):
        r = client.post(f"/v1/conversations/{cid}/messages", json={"content": "Hi"})
        assert error_of(r, 500, "internal") == "internal error"
        r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi, broken"}]})
        assert openai_error_of(r, 500, "server_error") == "internal error"
        # Streamed, the step fails before its first token: the same status and body as a plain request.
        r = client.post(f"/v1/conversations/{cid}/messages", json={"content": "Hi", "stream": True})
        assert error_of(r, 500, "internal") == "internal error"
        r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi, broken"}],
                                                      "stream": True})
        assert openai_error_of(r, 500, "server_error") == "internal error"
    assert "secret internals" not in r.text
    assert sum("secret internals" in (rec.exc_text or "") or "secret internals" in str(rec.exc_info) for rec in
               caplog.records) == 4


def test_openai_route_errors_from_the_edge(tmp_path):
    """401 and 413 on an OpenAI route come in OpenAI's shape too."""
    import httpx

    from session_runtime.api.settings import ApiSettings, load_credentials
    from tests.api.conftest import served

    settings = ApiSettings(credentials=load_credentials("k"), max_body_bytes=100)
    with served(settings) as live, httpx.Client(base_url=live.url, timeout=60) as c:
        r = c.post("/v1/chat/completions", json={"messages": []})
        assert openai_error_of(r, 401, "authentication_error", "invalid_api_key").startswith("no API key")
        openai_error_of(c.get("/v1/models"), 401, "authentication_error", "invalid_api_key")
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x" * 200}]},
                   headers={"authorization": "Bearer k"})
        assert openai_error_of(r, 413, "invalid_request_error", "request_too_large").startswith("the request body")
        error_of(c.post("/v1/conversations", json={"system": "x" * 200}, headers={"authorization": "Bearer k"}),
                 413, "request_too_large")
        assert c.get("/version").status_code == 200  # open


def test_no_docs_page_loads_outside_assets(client):
    """FastAPI's /docs and /redoc pull their scripts from a CDN: they are off;
    the OpenAPI schema they would draw is served."""
    for path in ("/docs", "/redoc"):
        assert error_of(client.get(path), 404, "not_found") == f"no route GET {path}"
    schema = client.get("/openapi.json").json()
    assert schema["info"] == {"title": "session-runtime", "version": importlib.metadata.version("session-runtime")}
    assert "/v1/chat/completions" in schema["paths"]
