"""API keys and tenants over real loopback HTTP: without a key 401; another
tenant's conversation is 404 on every route (the session API, the OpenAI route,
/debug/tree) and left as it was; the body's `tenant` needs the admin key;
/debug/* shows a tenant its own nodes and chains, the admin all; /admin/* and
(with the flag) /metrics need the admin key; /health stays open. And the CLI's
checks of the key flags and of a public --host, before anything heavy loads.
"""

from __future__ import annotations

import base64
import json
import sys

import httpx
import openai
import pytest
from openai import OpenAI

from session_runtime.api.settings import ApiSettings, Caller, load_credentials
from session_runtime.cli import main

from tests.api.conftest import create, error_of, openai_error_of, served, snapshot, step_ok

ADMIN, DEFAULT, KEY_A, KEY_B = "admin-key-0", "default-key-0", "key-of-a", "key-of-b"
FORCED = {"reasoning": "Think.", "content": "Done."}


def bearer(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    """A server with an admin key, a default tenant's key and two tenants (a, b)."""
    keys = tmp_path_factory.mktemp("keys") / "keys.json"
    keys.write_text(json.dumps({KEY_A: "a", KEY_B: "b"}))
    settings = ApiSettings(credentials=load_credentials(DEFAULT, str(keys), ADMIN))
    with served(settings) as live:
        yield live


@pytest.fixture(scope="module")
def clients(keyed):
    made = {name: httpx.Client(base_url=keyed.url, timeout=120, headers=bearer(key) if key else None)
            for name, key in (("none", None), ("admin", ADMIN), ("default", DEFAULT), ("a", KEY_A), ("b", KEY_B))}
    yield made
    for c in made.values():
        c.close()


def turn(client: httpx.Client, system: str, content: str = "Hello", **create_body) -> str:
    cid = create(client, system=system, **create_body)
    step_ok(client.post(f"/v1/conversations/{cid}/messages", json={"content": content, "forced": FORCED}))
    return cid


def test_without_a_key_every_route_but_health_is_401(clients, keyed):
    anon = clients["none"]
    cid = turn(clients["a"], "[auth-401] A's conversation.")
    requests = [("POST", "/v1/conversations", {}), ("GET", f"/v1/conversations/{cid}", None),
                ("DELETE", f"/v1/conversations/{cid}", None),
                ("POST", f"/v1/conversations/{cid}/messages", {"content": "hi"}),
                ("POST", f"/v1/conversations/{cid}/tool_results", {"results": [{"tool_call_id": "x"}]}),
                ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                ("GET", "/debug/tree", None), ("GET", "/debug/tree.html", None),
                ("POST", "/admin/workers/w0/drain", None)]
    for key in (None, "wrong-key"):
        headers = bearer(key) if key else {}
        for method, path, body in requests:
            r = anon.request(method, path, json=body, headers=headers)
            message = (openai_error_of(r, 401, "authentication_error", "invalid_api_key")
                       if path.startswith("/v1/chat/") else error_of(r, 401, "unauthorized"))
            assert message == ("no API key: send the header 'Authorization: Bearer KEY' (or 'x-api-key: KEY')" if key is None
                               else "the API key is not valid"), (method, path)
            assert r.headers["www-authenticate"] == (
                'Basic realm="session-runtime"' if path.startswith("/debug/") else "Bearer")
    # A header that names no key, or another scheme, is no key either.
    for header in ("Bearer", "Token " + KEY_A, KEY_A, "Basic !!!"):
        error_of(anon.get(f"/v1/conversations/{cid}", headers={"Authorization": header}), 401, "unauthorized")
    assert anon.get("/health").status_code == 200
    assert anon.get("/metrics").status_code == 200  # open by default
    assert clients["a"].get(f"/v1/conversations/{cid}").json()["trace"][1]["content"] == "Done."


def test_another_tenants_conversation_is_404_and_untouched(clients):
    a, b = clients["a"], clients["b"]
    cid = turn(a, "[auth-404] A's private conversation.")
    before = snapshot(a, cid)
    missing = error_of(b.get("/v1/conversations/no-such-id"), 404, "not_found")
    assert missing == "conversation 'no-such-id' not found"
    for method, path, body in [("GET", f"/v1/conversations/{cid}", None),
                               ("GET", f"/v1/conversations/{cid}?tokens=1", None),
                               ("DELETE", f"/v1/conversations/{cid}", None),
                               ("POST", f"/v1/conversations/{cid}/messages", {"content": "mine now"}),
                               ("POST", f"/v1/conversations/{cid}/messages", {"content": "x", "stream": True}),
                               ("POST", f"/v1/conversations/{cid}/tool_results",
                                {"results": [{"tool_call_id": "call_0_0", "content": "x"}]}),
                               ("GET", f"/debug/tree?conversation={cid}", None)]:
        r = b.request(method, path, json=body)
        assert error_of(r, 404, "not_found") == f"conversation {cid!r} not found", (method, path)
    assert snapshot(a, cid) == before
    # The default tenant's key is a tenant like the others.
    error_of(clients["default"].get(f"/v1/conversations/{cid}"), 404, "not_found")


def test_the_openai_route_with_another_tenants_conversation_id_is_404(clients, keyed):
    a = clients["a"]
    with OpenAI(base_url=f"{keyed.url}/v1", api_key=KEY_A, max_retries=0, timeout=120) as oai_a, \
         OpenAI(base_url=f"{keyed.url}/v1", api_key=KEY_B, max_retries=0, timeout=120) as oai_b:
        messages = [{"role": "system", "content": "[auth-oai] A's."}, {"role": "user", "content": "Hi"}]
        oai_a.chat.completions.create(model="tiny", messages=messages, max_tokens=2,
                                      extra_body={"conversation_id": "auth-oai-a", "create": True})
        before = snapshot(a, "auth-oai-a")
        for history in (messages, [{"role": "user", "content": "Replace A's history"}]):
            with pytest.raises(openai.NotFoundError) as e:
                oai_b.chat.completions.create(model="tiny", messages=history, max_tokens=2,
                                              extra_body={"conversation_id": "auth-oai-a"})
            assert e.value.response.json()["error"]["message"] == (
                "conversation 'auth-oai-a' not found; to create it with this id, send \"create\": true with "
                "conversation_id")
        with pytest.raises(openai.ConflictError) as e:  # ids are the server's: B cannot take A's
            oai_b.chat.completions.create(model="tiny", messages=messages, max_tokens=2,
                                          extra_body={"conversation_id": "auth-oai-a", "create": True})
        assert e.value.response.json()["error"]["message"] == "conversation_id 'auth-oai-a' is taken; choose another"
        assert snapshot(a, "auth-oai-a") == before
        with pytest.raises(openai.AuthenticationError):
            with OpenAI(base_url=f"{keyed.url}/v1", api_key="wrong", max_retries=0) as bad:
                bad.chat.completions.create(model="tiny", messages=messages, max_tokens=1)


def test_the_body_tenant_needs_the_admin_key(clients):
    a, admin = clients["a"], clients["admin"]
    r = a.post("/v1/conversations", json={"system": "[auth-tenant]", "tenant": "b"})
    assert error_of(r, 403, "forbidden") == "the tenant comes from the API key: only the admin key may set 'tenant'"
    # Naming one's own tenant is no change.
    assert a.get(f"/v1/conversations/{create(a, system='[auth-tenant]', tenant='a')}").json()["tenant"] == "a"
    assert a.get(f"/v1/conversations/{create(a, system='[auth-tenant]')}").json()["tenant"] == "a"
    # The admin creates for b: b sees it, a does not; the admin sees every tenant's.
    cid = create(admin, system="[auth-tenant] Made for b.", tenant="b")
    assert clients["b"].get(f"/v1/conversations/{cid}").json()["tenant"] == "b"
    error_of(a.get(f"/v1/conversations/{cid}"), 404, "not_found")
    assert admin.get(f"/v1/conversations/{cid}").status_code == 200
    # Without a body tenant the admin's and the default key's go to the default tenant.
    assert admin.get(f"/v1/conversations/{create(admin, system='[auth-tenant]')}").json()["tenant"] is None
    own = create(clients["default"], system="[auth-tenant] default")
    assert clients["default"].get(f"/v1/conversations/{own}").json()["tenant"] is None
    assert clients["admin"].delete(f"/v1/conversations/{cid}").json() == {"id": cid, "deleted": True}


def test_debug_tree_shows_a_tenant_only_its_own(clients, keyed):
    system = "[auth-tree] The same system prompt for both tenants, long enough for a page or two."
    cid_a, cid_b = turn(clients["a"], system), turn(clients["b"], system)
    trees = {name: clients[name].get("/debug/tree").json() for name in ("a", "b", "admin")}
    salts = {name: {n["cache_salt"] for n in t["nodes"]} for name, t in trees.items()}
    assert salts["a"] == {"a"} and salts["b"] == {"b"} and {"a", "b"} <= salts["admin"]
    ids = {name: {n["id"] for n in t["nodes"]} for name, t in trees.items()}
    assert ids["a"] and ids["b"] and not ids["a"] & ids["b"] and ids["a"] | ids["b"] <= ids["admin"]
    mine_a = keyed.runtime.conversations_of("a")
    assert set(trees["a"]["chains"]) == mine_a and cid_a in mine_a and cid_b not in trees["a"]["chains"]
    assert all(set(n["owners"]) <= mine_a for n in trees["a"]["nodes"])
    assert {cid_a, cid_b} <= set(trees["admin"]["chains"])
    # A's own chain, by conversation, matches the admin's view of it.
    def chain_of(name):
        nodes = clients[name].get("/debug/tree", params={"conversation": cid_a}).json()["nodes"]
        return [{k: v for k, v in n.items() if k != "last_access_age_s"} for n in nodes]

    assert chain_of("a") == chain_of("admin") and chain_of("a")
    # The integrity check, on request, is the admin's alone.
    assert clients["admin"].get("/debug/tree", params={"check": "true"}).json()["integrity"] == {"ok": True, "ranks": 1}
    assert "integrity" not in clients["a"].get("/debug/tree", params={"check": "true"}).json()
    # The page opens with the key as a Basic password (what a browser sends after its prompt).
    basic = "Basic " + base64.b64encode(f"anyone:{KEY_A}".encode()).decode()
    page = clients["none"].get("/debug/tree.html", headers={"Authorization": basic})
    assert page.status_code == 200 and page.text.startswith("<!doctype html>")
    assert clients["none"].get("/debug/tree", headers={"Authorization": basic}).json()["chains"] == trees["a"]["chains"]


def test_admin_routes_need_the_admin_key(clients):
    for name in ("a", "default"):
        r = clients[name].post("/admin/workers/w0/drain")
        assert error_of(r, 403, "forbidden") == "/admin/workers/w0/drain needs the admin key"
    # The admin gets through to the route (the embedded engine has no workers).
    error_of(clients["admin"].post("/admin/workers/w0/drain"), 404, "not_found")


def test_a_lone_api_key_is_the_admin_and_metrics_can_be_admin_only():
    settings = ApiSettings(credentials=load_credentials(api_key="solo-key"), metrics_admin_only=True)
    with served(settings) as live, httpx.Client(base_url=live.url, timeout=120) as anon, \
         httpx.Client(base_url=live.url, timeout=120, headers=bearer("solo-key")) as solo:
        error_of(anon.get("/metrics"), 401, "unauthorized")
        assert anon.get("/health").status_code == 200
        assert solo.get("/metrics").status_code == 200
        assert solo.get(f"/v1/conversations/{create(solo, system='[auth-solo]')}").json()["tenant"] is None
        cid = create(solo, system="[auth-solo]", tenant="t1")  # the admin acts for a tenant
        assert solo.get(f"/v1/conversations/{cid}").json()["tenant"] == "t1"


def test_metrics_admin_only_refuses_a_tenant(tmp_path):
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({KEY_A: "a"}))
    settings = ApiSettings(credentials=load_credentials(None, str(keys), ADMIN), metrics_admin_only=True)
    with served(settings) as live, httpx.Client(base_url=live.url, timeout=120) as c:
        assert error_of(c.get("/metrics", headers=bearer(KEY_A)), 403, "forbidden") == "/metrics needs the admin key"
        assert c.get("/metrics", headers=bearer(ADMIN)).status_code == 200


# ----- the flags ------------------------------------------------------------------


def test_load_credentials():
    creds = load_credentials("k1")
    assert creds.identify("k1") == Caller(tenant=None, admin=True) and creds.identify("k2") is None
    creds = load_credentials("k1", admin_key="adm")
    assert (creds.identify("k1"), creds.identify("adm")) == (Caller(None, False), Caller(None, True))
    assert not load_credentials().enabled


@pytest.mark.parametrize("content, message", [
    ("not json", "not JSON"),
    ("[]", 'must be a non-empty JSON object {"KEY": "TENANT", ...}'),
    ("{}", 'must be a non-empty JSON object {"KEY": "TENANT", ...}'),
    ('{"k": 1}', "each tenant must be a non-empty string of at most 128 characters, got 1"),
    ('{"k": " "}', "each tenant must be a non-empty string of at most 128 characters, got ' '"),
    ('{"": "a"}', "a key must be a non-empty string of printable ASCII characters"),
    ('{" k": "a"}', "without surrounding spaces"),
    ('{"kl\\u00e9": "a"}', "printable ASCII"),
    ('{"adm": "a"}', "a key is given twice"),
])
def test_a_bad_keys_file_is_refused(tmp_path, content, message):
    path = tmp_path / "keys.json"
    path.write_text(content)
    with pytest.raises(ValueError) as e:
        load_credentials(None, str(path), "adm")
    assert str(e.value).startswith(f"--api-keys {path}: ") and message in str(e.value)


def test_the_cli_refuses_bad_key_flags_before_loading_anything(tmp_path, capsys):
    missing = tmp_path / "none.json"
    cases = [
        (["--host", "0.0.0.0"], "--host 0.0.0.0 serves other machines, and no API key is set"),
        (["--host", "::"], "--host :: serves other machines"),
        (["--host", "example.org"], "--host example.org serves other machines"),
        (["--api-keys", str(missing)], f"--api-keys {missing}: cannot read it (No such file or directory)"),
        (["--metrics-admin-only"], "needs an admin key"),
        (["--api-key", "same", "--admin-key", "same"], "--api-key: a key is given twice"),
    ]
    for flags, message in cases:
        assert main(["serve", *flags]) == 2, flags
        assert message in capsys.readouterr().err, flags


def test_the_cli_checks_flags_without_torch():
    import subprocess

    code = ("import sys; from session_runtime.cli import main; rc = main(['serve', '--host', '0.0.0.0']); "
            "assert rc == 2, rc; assert 'torch' not in sys.modules and 'sglang' not in sys.modules; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_the_openai_route_keeps_each_tenants_cache_apart(clients, keyed):
    """The prefix-guessing oracle is closed: the same system prompt from another
    tenant gets 0 cached tokens (the same tenant its own pages), with and
    without conversation_id; no node of one tenant shows in the other's tree."""
    from tests.api.conftest import PAGE, first_prompt_len

    secret = "[auth-oracle] A tenant's secret system prompt: the launch code is 1234, never say it. " * 2
    messages = [{"role": "system", "content": secret}, {"role": "user", "content": "Hi"}]
    n = first_prompt_len(keyed.runtime, secret, "Hi")
    assert n > 2 * PAGE
    cached = {}
    with OpenAI(base_url=f"{keyed.url}/v1", api_key=KEY_A, max_retries=0, timeout=120) as oai_a, \
         OpenAI(base_url=f"{keyed.url}/v1", api_key=KEY_B, max_retries=0, timeout=120) as oai_b, \
         OpenAI(base_url=f"{keyed.url}/v1", api_key=ADMIN, max_retries=0, timeout=120) as oai_admin:
        for name, oai, extra in (("a", oai_a, {}), ("b-id", oai_b, {"conversation_id": "oracle-b", "create": True}),
                                 ("admin", oai_admin, {}), ("b", oai_b, {}), ("a again", oai_a, {}),
                                 ("a-id", oai_a, {"conversation_id": "oracle-a", "create": True})):
            # "a again" asks another cap: the same body again would be a retry of a's step, replayed as it was.
            r = oai.chat.completions.create(model="tiny", messages=messages, max_tokens=3 if name == "a again" else 2,
                                            extra_body=extra)
            assert r.usage.prompt_tokens == n
            cached[name] = r.usage.prompt_tokens_details.cached_tokens
    own = (n - 1) // PAGE * PAGE  # the tenant's own whole pages (as for one tenant alone)
    assert cached == {"a": 0, "b-id": 0, "admin": 0, "b": own, "a again": own, "a-id": own}
    previews = {name: " ".join(n["preview"] for n in clients[name].get("/debug/tree").json()["nodes"])
                for name in ("a", "b")}
    assert "launch code" in previews["a"] and "launch code" in previews["b"]  # each its own copy
    salts = {name: {n["cache_salt"] for n in clients[name].get("/debug/tree").json()["nodes"]} for name in ("a", "b")}
    assert salts == {"a": {"a"}, "b": {"b"}}
    assert keyed.runtime.get("oracle-a").tenant == "a" and keyed.runtime.get("oracle-b").tenant == "b"


def test_an_unexpected_host_header_is_400(tmp_path):
    """DNS rebinding: a page of another site that resolves its name to this
    server sends its own name as Host; only the server's names are answered."""
    from session_runtime.api.settings import allowed_hosts
    from session_runtime.cli import api_settings_from_args, build_parser

    settings = ApiSettings(allowed_hosts=allowed_hosts("127.0.0.1", "agents.internal"))
    with served(settings) as live, httpx.Client(base_url=live.url, timeout=60) as c:
        for host in (f"127.0.0.1:{live.port}", f"localhost:{live.port}", "LOCALHOST", f"[::1]:{live.port}",
                     "agents.internal:443"):
            assert c.get("/health", headers={"host": host}).status_code == 200, host
        r = c.get("/health", headers={"host": f"rebound.example:{live.port}"})
        assert error_of(r, 400, "invalid_host") == (
            f"the Host header 'rebound.example:{live.port}' is not one this server answers to "
            "(127.0.0.1, [::1], agents.internal, localhost; see --allowed-hosts)")
        r = c.post("/v1/chat/completions", json={"messages": []}, headers={"host": "rebound.example"})
        openai_error_of(r, 400, "invalid_request_error", "invalid_host")
        before = len(live.runtime.conversations)
        error_of(c.post("/v1/conversations", json={}, headers={"host": "rebound.example"}), 400, "invalid_host")
        assert len(live.runtime.conversations) == before

    def hosts(*flags):
        return api_settings_from_args(build_parser().parse_args(["serve", *flags])).allowed_hosts

    assert hosts() == {"127.0.0.1", "localhost", "[::1]"}
    assert hosts("--host", "::", "--insecure", "--allowed-hosts", "a.example,B.example") == {
        "[::]", "127.0.0.1", "localhost", "[::1]", "a.example", "b.example"}
    assert hosts("--allowed-hosts", "*") is None


def test_the_access_log_has_one_line_per_request_and_no_user_text(clients, caplog):
    import logging
    import re

    with caplog.at_level(logging.INFO, logger="session_runtime.access"):
        cid = turn(clients["a"], "[auth-log] SECRET system text", content="SECRET user text")
        clients["b"].get(f"/v1/conversations/{cid}", params={"tokens": "1"})
        clients["none"].get("/debug/tree")
        clients["admin"].get("/health")
        clients["none"].get("/health")
    lines = [r.getMessage() for r in caplog.records if r.name == "session_runtime.access"]
    shapes = [re.sub(r"\d+\.\dms$", "MS", line) for line in lines]
    assert shapes == ["POST /v1/conversations 201 tenant=a MS",
                      f"POST /v1/conversations/{cid}/messages 200 tenant=a MS",
                      f"GET /v1/conversations/{cid} 404 tenant=b MS",
                      "GET /debug/tree 401 tenant=- MS",
                      "GET /health 200 tenant=admin MS", "GET /health 200 tenant=- MS"]
    assert not any("SECRET" in line or "tokens" in line for line in lines)


def test_anthropics_sdk_authenticates_with_x_api_key(keyed):
    """Anthropic's SDK sends its key as `x-api-key`: it names the caller as a
    Bearer key does, and a wrong one is Anthropic's 401."""
    import anthropic

    body = dict(model="tiny", max_tokens=2, messages=[{"role": "user", "content": "Hi"}])
    with anthropic.Anthropic(base_url=keyed.url, api_key=KEY_A, max_retries=0, timeout=120) as good:
        assert good.messages.create(**body).usage.output_tokens == 2
    with anthropic.Anthropic(base_url=keyed.url, api_key="wrong", max_retries=0, timeout=120) as bad:
        with pytest.raises(anthropic.AuthenticationError) as e:
            bad.messages.create(**body)
    assert e.value.body == {"type": "error", "error": {"type": "authentication_error",
                                                       "message": "the API key is not valid"}}
    r = httpx.get(f"{keyed.url}/v1/models", headers={"x-api-key": KEY_B})
    assert r.status_code == 200


def test_the_gemini_routes_take_the_key_as_googles_clients_send_it(keyed):
    """`x-goog-api-key`, or `?key=`; without one (or with a wrong one) Google's 401."""
    body = {"contents": [{"role": "user", "parts": [{"text": "[auth-gemini] Count me."}]}]}
    path = "/v1beta/models/tiny:countTokens"
    with httpx.Client(base_url=keyed.url, timeout=120) as c:
        for headers, params in (({}, {}), ({"x-goog-api-key": "wrong-key"}, {}), ({}, {"key": "wrong-key"})):
            r = c.post(path, json=body, headers=headers, params=params)
            assert r.status_code == 401, r.text
            assert r.json()["error"]["status"] == "UNAUTHENTICATED" and r.json()["error"]["code"] == 401
        counts = [c.post(path, json=body, headers=headers, params=params)
                  for headers, params in (({"x-goog-api-key": KEY_A}, {}), ({}, {"key": KEY_B}), (bearer(KEY_A), {}))]
        assert [r.status_code for r in counts] == [200] * 3 and len({r.json()["totalTokens"] for r in counts}) == 1
        # A key in the query names the caller on the Gemini routes only.
        assert c.get("/v1/conversations", params={"key": KEY_A}).status_code == 401
