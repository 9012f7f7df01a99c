"""Read-only views of a Runtime: a conversation's layers, the tree, /metrics' samples.

The runtime's part for them (core.py builds it with the conversations'
table, the backend, the tokenizer, the templates, the store's part for the
fleet, the session index, the auto policy and the materializer), kept apart
from the code that changes state; it changes nothing.
"""

from __future__ import annotations

import bisect
from typing import Optional

from radix_ext.tree import NodeInfo
from session_runtime.errors import BackendUnavailable, ConversationNotFound, WorkerNotFound
from session_runtime.metrics import Sample, counter, gauge


class RuntimeInspection:
    def __init__(self, table, backend, tokenizer, template, storage, sessions, auto, materializer):
        self.table, self.backend, self.tokenizer, self.template = table, backend, tokenizer, template
        self.storage, self.sessions, self.auto, self.materializer = storage, sessions, auto, materializer
        self.conversations = table.registry
        self.get = table.get

    def describe(self, conversation_id: str, tokens: bool = False) -> dict:
        """Trace, canonical history, per-turn accounting and the chain."""
        conv = self.get(conversation_id)
        try:
            chain_len = self.backend.peek_chain_tokens(conv.id)
        except BackendUnavailable:  # the layers are ours; only the physical state is unknown
            chain_len = None
        out = {
            "id": conv.id, "system": conv.system, "tenant": conv.tenant, "template": conv.template,
            "policy": conv.policy.name, "keep_last_k": conv.policy.keep_last_k,
            "materialize": conv.materialize.mode, "tools": conv.tools,
            "trace": [e.as_dict() for e in conv.trace],
            "history": [{"role": m.role, "turn": m.turn, "content": m.content, "reasoning": m.reasoning,
                         "tool_calls": [c.as_dict() for c in m.tool_calls], "tool_call_id": m.tool_call_id}
                        for m in conv.history],
            "pending_tool_calls": [c.as_dict() for c in conv.protocol.pending_calls] if conv.protocol else [],
            "turns": [t.as_dict() for t in conv.turns],
            "chain": {
                "sequence_tokens": len(conv.chain_tokens), "cached_tokens": chain_len,
                "kind": conv.canonical_kind,
                "kv_device_bytes": None if chain_len is None else chain_len * self.backend.bytes_per_token,
                "kv_host_bytes": self.backend.host_bytes(conv.id),
            },
            "offload": conv.offload.mode,
            "inferred": conv.inferred,  # the protocol of the stateless client it was inferred from; None: explicit
            "worker": self.backend.worker_of(conv.id) or conv.worker,
        }
        if tokens:
            # What the tree holds: the chain is a prefix of the canonical rendering
            # (the generated sequence inside an open turn; after a close, the fork
            # and, once materialized, the canonical branch). The generated
            # sequence itself is the trace's.
            keep = conv.kept_reasoning()
            canonical = self.template(conv.template).render(conv.system, conv.tools, conv.history, keep, False).ids
            out["chain"]["token_ids"] = canonical[: chain_len or 0]
            out["chain"]["sequence_token_ids"] = list(conv.chain_tokens)
        return out

    def list_conversations(self, tenant: Optional[str], everyone: bool = False, after: Optional[str] = None,
                           limit: int = 100) -> dict:
        """A page of conversations (the tenant's; `everyone`: every tenant's),
        by id after `after`: each one's id, tenant, policy, turn count, state
        and whether it was inferred from a stateless client (its protocol) or
        named by one (None). `{"data": [...], "has_more": bool}`."""
        with self.table.lock:
            ids = sorted(self.conversations if everyone else self.conversations.ids_of(tenant))
        if after is not None:
            ids = ids[bisect.bisect_right(ids, after):]
        data = []
        for cid in ids[:limit]:
            try:
                conv = self.get(cid)
            except ConversationNotFound:
                continue  # deleted since the ids were read
            data.append({"id": conv.id, "tenant": conv.tenant, "inferred": conv.inferred, "policy": conv.policy.name,
                         "turns": len(conv.turns), "sequence_tokens": len(conv.chain_tokens),
                         "state": "tool_wait" if conv.protocol is not None else ("idle" if conv.turns else "new")})
        return {"data": data, "has_more": len(ids) > limit}

    def chain_view(self, conversation_id: str) -> dict:
        """A conversation's chain as the tree page draws it: where it is held
        (device, host), the private partial page, each turn's steps (where each
        output began and why its uncached tokens were prefilled), each closed
        turn's fork, the branch it dropped, and its canonical branch."""
        conv = self.get(conversation_id)
        bpt = self.backend.bytes_per_token
        try:
            device = self.backend.peek_chain_tokens(conv.id)
            host = self.backend.host_bytes(conv.id) // bpt if bpt else 0
        except BackendUnavailable:
            device, host = None, 0
        return {
            "id": conv.id, "policy": conv.policy.name, "offload": conv.offload.mode, "inferred": conv.inferred,
            "sequence_tokens": len(conv.chain_tokens), "device_tokens": device, "host_tokens": host,
            "kind": conv.canonical_kind,
            "state": "tool_wait" if conv.protocol is not None else ("idle" if conv.turns else "new"),
            "worker": self.backend.worker_of(conv.id) or conv.worker,
            "turns": [{
                "turn": t.index, "closed": t.closed, "fork": t.fork_tokens, "dropped": t.dropped_tokens,
                "freed": t.branch_freed, "materialize": t.materialize, "auto": t.auto,
                "canonical": {"prefill_tokens": t.materialized_prefill_tokens, "at": t.materialized_at}
                if t.materialized_at is not None else None,
                "steps": [{"step": i, "prompt_tokens": s.prompt_tokens, "output_tokens": s.output_tokens,
                           "cached_tokens": (s.cached_input_tokens or 0) + s.host_loaded_tokens,
                           "uncached_tokens": s.uncached_prefill_tokens, "uncached": s.uncached}
                          for i, s in enumerate(t.steps)],
            } for t in conv.turns],
        }

    def tree_snapshot(self, conversation: Optional[str] = None, worker: Optional[str] = None) -> list[NodeInfo]:
        """The tree (many workers: every live worker's, or one `worker`'s; a
        conversation's chain is read on its own worker). Raises WorkerNotFound."""
        if conversation is not None:
            self.get(conversation)
        if worker is not None:
            if worker not in getattr(self.backend, "workers", {}):
                raise WorkerNotFound(worker)
            return self.backend.snapshot(self.tokenizer.decode, owner=conversation, worker=worker)
        return self.backend.snapshot(self.tokenizer.decode, owner=conversation)

    def integrity(self) -> dict:
        """The integrity check as a report: {"ok": True, ...the backend's figures}
        or {"ok": False, "error": ...}."""
        try:
            report = self.backend.integrity()  # the backend's check, once
            self.check_chains()
            return {"ok": True, **report}
        except AssertionError as exc:
            return {"ok": False, "error": str(exc)}

    def check_chains(self) -> None:
        """Every chain the backend holds has a conversation here."""
        for cid in self.backend.chain_lengths():
            with self.table.lock:
                assert cid in self.conversations, f"chain {cid} has no conversation"

    def chains(self) -> dict[str, int]:
        """Tokens each conversation's chain holds in the tree."""
        held = self.backend.peek_chain_lengths()
        with self.table.lock:
            return {cid: held.get(cid, 0) for cid in list(self.conversations)}

    def conversations_of(self, tenant: Optional[str]) -> set[str]:
        """Ids of the tenant's conversations (None: the default tenant's)."""
        with self.table.lock:
            return self.conversations.ids_of(tenant)

    def metric_samples(self) -> list[Sample]:
        """The runtime's and the backend's figures for /metrics (many workers:
        labelled per worker)."""
        try:
            pools = self.backend.metric_samples()
        except BackendUnavailable:
            pools = []
        stats = self.materializer.stats
        fleet = []
        member = self.storage.fleet
        if member is not None:  # which process answered: its id as a label
            fleet = [gauge("fleet_member", 1.0, "This runtime process in a fleet over one store (label: its id)"
                           ).labelled(member=member.id),
                     gauge("fleet_members_live", len(member.live()), "Runtime processes live over the store")]
        return [
            *pools,
            *fleet,
            gauge("backend_up", float(bool(pools)), "1 when the backend answered for its pool figures, else 0"),
            gauge("conversations", len(self.conversations), "Conversations held"),
            gauge("conversations_resident", self.conversations.resident,
                  "Conversations in memory (the others are read from the store at their next use)"),
            gauge("conversations_inferred", len(self.sessions),
                  "Conversations inferred from stateless clients' histories (in this process's index)"),
            *(counter("stateless_requests_total", self.sessions.matched[how],
                      "Stateless requests served, by how their conversation was found (new: none matched)"
                      ).labelled(match=how) for how in ("history", "session_key", "retry", "new")),
            *(counter("auto_choices_total", n, "Turns policy auto kept or dropped the reasoning of (reason: close, "
                      "at the turn's close; not_resident, dropped later, the chain being gone)"
                      ).labelled(choice=choice, reason=reason)
              for (choice, reason), n in sorted(self.auto.counts().items())),
            counter("materialized_total", stats["done"], "Canonical-branch materializations done"),
            counter("materialize_cancelled_total", stats["cancelled"],
                    "Materializations cancelled before they ran (a newer job or a user step came first)"),
            counter("materialize_joined_total", stats["joined"],
                    "User steps that waited for their conversation's running materialization"),
        ]
