"""Conversations per tenant are bounded; an undo never deletes a turn another
request committed."""

from __future__ import annotations

import pytest

from session_runtime import Runtime, RuntimeConfig
from session_runtime.errors import TooManyConversations


@pytest.fixture
def rt():
    runtime = Runtime(RuntimeConfig(model="tiny", pool_tokens=4096, max_context=512, max_conversations_per_tenant=2),
                      background=False)
    yield runtime
    runtime.close()


def test_a_tenant_keeps_at_most_its_limit_of_conversations(rt):
    a = [rt.create_conversation(tenant="a") for _ in range(2)]
    with pytest.raises(TooManyConversations) as err:
        rt.create_conversation(tenant="a")
    assert err.value.status == 429 and len(rt.conversations) == 2
    rt.create_conversation(tenant="b")  # another tenant has its own count
    rt.delete_conversation(a[0])
    rt.create_conversation(tenant="a")  # room again


def test_a_versioned_delete_leaves_a_conversation_another_request_committed_to(rt):
    cid = rt.create_conversation(tenant="a")
    created = rt.get(cid).version
    rt.send_message(cid, "Hello", max_tokens=2)  # another request's turn
    assert rt.delete_conversation(cid, if_version=created) is False
    assert len(rt.get(cid).turns) == 1
    assert rt.delete_conversation(cid, if_version=rt.get(cid).version) is True


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}


@pytest.mark.parametrize("tools, message", [
    ({"a": 1}, "tools must be a list of objects"),
    ([1], "tools[0] must be an object"),
    ([{"type": "retrieval"}], "tools[0].type must be 'function', got 'retrieval'"),
    ([{"type": "function", "function": "f"}], "tools[0].function must be an object"),
    ([{"type": "function", "function": {"name": "a b"}}],
     "tools[0].function.name must be 1 to 64 letters, digits, '_' or '-', got 'a b'"),
    ([{"name": "x" * 65}], "tools[0].name must be 1 to 64 letters, digits, '_' or '-', got '" + "x" * 65 + "'"),
    ([{"name": "f", "parameters": []}], "tools[0].parameters must be a JSON schema object"),
    ([{"name": "f", "description": 3}], "tools[0].description must be a string"),
    ([WEATHER, WEATHER], "tools[1]: a second function named 'get_weather'"),
    ([{"name": f"f{i}"} for i in range(129)], "129 tools are more than this server takes for one conversation "
                                                "(128, --max-tools)"),
    ([{"name": "f", "description": "d" * (256 * 1024)}],
     "tools of 262178 bytes are more than this server takes for one conversation (262144, --max-tools-bytes)"),
])
def test_tools_are_checked_when_a_conversation_is_created(rt, tools, message):
    from session_runtime.errors import InvalidRequest

    with pytest.raises(InvalidRequest) as err:
        rt.create_conversation(tools=tools)
    assert (str(err.value), err.value.param) == (message, "tools")
    assert rt.conversations == {}


def test_tools_that_cannot_fit_the_context_are_413_before_tokenizing_them_whole(rt):
    from session_runtime.errors import ContextTooLong

    tools = [{"name": f"f{i}", "description": "word " * 400} for i in range(3)]  # 1,200 words, context 512
    with pytest.raises(ContextTooLong) as err:
        rt.create_conversation(tools=tools)
    assert str(err.value).startswith("tools of 6") and str(err.value).endswith(
        "bytes has more tokens than the context of 512; it was not tokenized whole")
    cid = rt.create_conversation(tools=[WEATHER])  # the OpenAI shape and the bare function both pass
    assert rt.get(cid).tools == [WEATHER]


def test_a_long_text_is_refused_after_tokenizing_about_a_context_of_it(rt):
    """125 KB of words against a context of 512: fewer bytes than 512 of the
    longest token could cover, so the byte bound cannot refuse it; one chunk of
    at most 32K characters is tokenized, not the whole text."""
    from session_runtime.errors import ContextTooLong

    cid = rt.create_conversation(tenant="a")
    text = "word " * 25_000
    assert len(text) <= rt.config.max_context * rt.tokenizer.max_token_bytes
    calls = []
    real = rt.tokenizer.plain.encode
    object.__setattr__(rt.tokenizer, "plain", type("Spy", (), {"encode": lambda self, t, **k: calls.append(len(t))
                                                               or real(t, **k)})())
    try:
        with pytest.raises(ContextTooLong):
            rt.send_message(cid, text)
    finally:
        object.__setattr__(rt.tokenizer, "plain", real.__self__)
    assert len(calls) == 1 and calls[0] <= 1 << 15
    assert rt.get(cid).turns == []
    # Unsure is no: a text that fits is left to the real rendering.
    assert rt.tokenizer.surely_more_tokens_than("word " * 500, 512) is False
    assert rt.tokenizer.surely_more_tokens_than("word " * 520, 512) is True


def test_a_tenant_holds_at_most_its_budget_of_stored_bytes():
    from session_runtime.errors import TenantStorageFull
    from session_runtime.store.delta import delta

    runtime = Runtime(RuntimeConfig(model="tiny", pool_tokens=4096, max_context=512, max_tenant_bytes=3000),
                      background=False)
    try:
        a = runtime.create_conversation(tenant="a", system="word " * 200)
        runtime.send_message(a, "hello", max_tokens=2)
        # Kept step by step as a store would hold it: what writing it whole would take.
        assert runtime.table.held("a") == delta(runtime.get(a), None).written.bytes
        b = runtime.create_conversation(tenant="a", system="word " * 380)
        assert runtime.table.held("a") > 3000
        with pytest.raises(TenantStorageFull) as err:
            runtime.send_message(a, "again", max_tokens=2)
        assert err.value.status == 429 and str(err.value).startswith("the tenant's conversations hold ")
        with pytest.raises(TenantStorageFull):
            runtime.create_conversation(tenant="a")
        assert len(runtime.get(a).turns) == 1
        runtime.create_conversation(tenant="b")  # another tenant has its own budget
        runtime.delete_conversation(b)
        runtime.send_message(a, "again", max_tokens=2)  # room again
    finally:
        runtime.close()
