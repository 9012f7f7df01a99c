"""Two runtime processes' worth of runtimes (two `Runtime`s, each a fleet
member over one PostgreSQL store) over the one shared SGLang server: each
conversation's chain is held by one runtime at a time.

- a member that starts leaves the other's chains alone (no `adopt`);
- when a member dies (its beat and its chains' lease stop), its chains go
  back to SGLang's LRU after the lease, the other member takes its
  conversations over, and its steps hold their chains under its own lease;
  the tree's integrity holds throughout."""

from __future__ import annotations

import time

from session_runtime.config import RuntimeConfig
from session_runtime.runtime import Runtime
from tests.conftest import SGLANG_POOL

LEASE, TTL = 5.0, 1.0  # a lease outlasts the stalls of a loaded 2-core machine (a 2 s one expired while b started)
TOOL = {"reasoning": "A tool first. " * 3, "tool_calls": [{"name": "f", "arguments": {"x": 1}}]}


def _member(folder, sglang_url: str, store: str, advertise: str) -> Runtime:
    return Runtime(RuntimeConfig(model=str(folder), backend="sglang", sglang_url=sglang_url, page_size=16,
                                 pool_tokens=SGLANG_POOL, template="deepseek", data_dir=None, offload="never",
                                 store=store, advertise_url=advertise, member_ttl_s=TTL, chain_lease_s=LEASE),
                   background=False)


def test_a_dead_members_chains_are_released_and_its_conversations_taken_over(sglang_runtime, tiny_hf_folder,
                                                                              pg_url):
    url = sglang_runtime.backend.url
    a = _member(tiny_hf_folder, url, pg_url, "http://a.invalid")
    b = None
    try:
        cids = [a.create_conversation(system=f"Fleet over SGLang {i}. " * 6, policy="drop") for i in range(3)]
        for cid in cids:
            a.send_message(cid, "Use the tool.", forced=TOOL)
        a.backend.after.flush()  # the turns' closes, sent after the steps answered
        held = a.backend.pools()["chains"]
        assert all(held.get(cid, 0) > 0 for cid in cids), held
        b = _member(tiny_hf_folder, url, pg_url, "http://b.invalid")  # starts: a's chains stay held
        assert all(b.backend.pools()["chains"].get(cid, 0) > 0 for cid in cids)
        # a dies: no beat, no lease renewal, nothing released.
        a.fleet._stop.set()
        a.backend._stop.set()
        time.sleep(LEASE + TTL + 1.0)
        b.fleet._beat()
        assert set(b.fleet.live()) == {b.fleet.id}
        assert not set(cids) & set(b.backend.pools()["chains"])  # back to the LRU after a's lease
        for cid in cids:
            route = b.fleet.route(cid)
            assert route.url is None and route.claimed
            b.take(cid, route.claimed)
            call = b.describe(cid)["pending_tool_calls"][0]["id"]
            step = b.send_tool_results(cid, [{"tool_call_id": call, "content": "ok"}],
                                       forced={"reasoning": "Done.", "content": "Finished."})
            acc = step.accounting
            assert acc.cached_input_tokens + acc.uncached_prefill_tokens == acc.prompt_tokens
        time.sleep(0.5)
        held = b.backend.pools()["chains"]
        assert all(held.get(cid, 0) > 0 for cid in cids), held  # held again, under b's lease
        b.check_integrity()
        for cid in cids:
            b.delete_conversation(cid)
    finally:
        for rt in (a, b):
            if rt is not None:
                rt.close()
    sglang_runtime.check_integrity()
