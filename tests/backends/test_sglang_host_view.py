"""On SGLang the tree view shows a chain whose tail waits on the scheduler's
host tier (a tool wait, offload `always`): its nodes are listed with residency
"host", as the embedded engine lists them, and the chain view counts their
tokens as host tokens; the next step reloads exactly those."""

from __future__ import annotations

import dataclasses

PAGE = 16


def test_a_tool_wait_on_the_host_tier_is_in_the_tree_view(sglang_rt):
    rt = sglang_rt
    cid = rt.create_conversation(system="Host view of a tool wait on SGLang, shown node by node. " * 8,
                                 policy="drop", offload="always", tenant="hv-offload")
    forced1 = {"reasoning": "I need a tool for this. " * 6, "tool_calls": [{"name": "f", "arguments": {"x": 1}}]}
    step = rt.send_message(cid, "Use the tool.", forced=forced1)
    before = rt.backend.chain_tokens(cid)
    private = before % PAGE  # the chain's partial last page: no tree node, as on the embedded engine
    on_device = rt.tree_snapshot(conversation=cid)
    assert on_device and {n.residency for n in on_device} == {"device"}
    assert sum(n.tokens for n in on_device) == before - private
    view = rt.chain_view(cid)
    assert (view["device_tokens"], view["host_tokens"], view["state"]) == (before, 0, "tool_wait")

    moved = rt.offload.run_due()
    anchor = before - moved
    assert moved > 0 and rt.backend.chain_tokens(cid) == anchor

    snap = rt.tree_snapshot(conversation=cid)
    device = [n for n in snap if n.residency == "device"]
    host = [n for n in snap if n.residency == "host"]
    assert len(device) + len(host) == len(snap) == len(on_device)
    assert sum(n.tokens for n in device) == anchor
    assert sum(n.tokens for n in host) == moved - private
    assert sum(n.tokens for n in snap) + private == before
    # The nodes that left the device, as the tree had them: ids, sizes, depths, a chain down from the anchor.
    was = {n.id: n for n in on_device}
    for n in host:
        assert (n.tokens, n.depth_tokens, n.namespace, n.cache_salt) == (
            was[n.id].tokens, was[n.id].depth_tokens, was[n.id].namespace, was[n.id].cache_salt)
        assert n.owners == (cid,) and n.lock_count == 0
    assert [n.id for n in host] == [n.id for n in on_device if n.depth_tokens > anchor]
    assert host[0].parent == (device[-1].id if device else None)
    assert [n.parent for n in host[1:]] == [n.id for n in host[:-1]]
    assert host[-1].depth_tokens == before - private
    # The whole tree lists them too, and the chain view counts them on the host.
    ageless = lambda nodes: [dataclasses.replace(n, last_access_age_s=0.0) for n in nodes]  # noqa: E731
    assert ageless(n for n in rt.tree_snapshot() if n.residency == "host" and cid in n.owners) == ageless(host)
    view = rt.chain_view(cid)
    assert (view["device_tokens"], view["host_tokens"]) == (anchor, moved)
    assert view["device_tokens"] + view["host_tokens"] == before == view["sequence_tokens"]
    rt.check_integrity()

    after = rt.send_tool_results(cid, [{"tool_call_id": step.tool_calls[0]["id"], "content": "ok"}],
                                 forced={"reasoning": "Got it.", "content": "The answer is 42."})
    acc = after.accounting
    assert acc.host_loaded_tokens == moved
    assert acc.cached_input_tokens == anchor
    assert acc.cached_input_tokens + acc.host_loaded_tokens + acc.uncached_prefill_tokens == acc.prompt_tokens
    # Back on the device: no host node is left, and the chain view says so.
    snap = rt.tree_snapshot(conversation=cid)
    assert snap and {n.residency for n in snap} == {"device"}
    assert not [n for n in rt.tree_snapshot() if n.residency == "host" and cid in n.owners]
    view = rt.chain_view(cid)
    assert view["host_tokens"] == 0 and view["device_tokens"] == rt.backend.chain_tokens(cid)
