"""A bounded schemathesis run over the OpenAPI schema, in process: every
operation with generated and malformed inputs. No response is a 5xx, and every
error body has the documented shape (`{"error": {"type", "message"}}` on the
session API, OpenAI's `{"error": {"message", "type", "param", "code"}}` on the
OpenAI routes, Anthropic's `{"type": "error", "error": {"type", "message"}}` on
/v1/messages, Google's `{"error": {"code", "message", "status"}}` on the Gemini
routes)."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, settings

from session_runtime import Runtime, RuntimeConfig
from session_runtime.api.app import create_app
from session_runtime.api.errors import is_anthropic_route, is_gemini_route, is_openai_route

RUNTIME = Runtime(RuntimeConfig(model="tiny", pool_tokens=4096, max_context=256, max_tokens_limit=4,
                                max_conversations_per_tenant=50), background=False)
APP = create_app(RUNTIME)
schema = schemathesis.openapi.from_asgi("/openapi.json", APP)
SEEN: dict[int, int] = {}


@pytest.fixture(scope="module", autouse=True)
def _close():
    yield
    RUNTIME.close()


@schema.parametrize()
@settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck), database=None)
def test_no_5xx_and_every_error_in_its_shape(case):
    if case.path == "/v1/conversations" and case.method == "POST":  # stay within the tenant's bound
        for cid in list(RUNTIME.conversations)[:-10]:
            RUNTIME.delete_conversation(cid)
    response = case.call()
    SEEN[response.status_code] = SEEN.get(response.status_code, 0) + 1
    assert response.status_code < 500, (case.method, case.path, response.status_code, response.text[:300])
    if response.status_code >= 400:
        body = response.json()
        if is_anthropic_route(case.path):
            assert set(body) == {"type", "error"} and body["type"] == "error", body
        else:
            assert set(body) == {"error"}, body
        want = {"message", "type", "param", "code"} if is_openai_route(case.path) else {"type", "message"}
        if is_gemini_route(case.path):
            want = {"code", "message", "status"}
        assert set(body["error"]) >= want and isinstance(body["error"]["message"], str), (case.path, body)


def test_the_run_reached_the_steps():
    """The generated requests got past validation too, not only 4xx."""
    print("statuses", dict(sorted(SEEN.items())))
    assert SEEN.get(200, 0) + SEEN.get(201, 0) > 0 and sum(SEEN.values()) > 50, SEEN
    RUNTIME.check_integrity()
