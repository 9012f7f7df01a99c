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
