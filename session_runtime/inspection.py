"""Read-only views of a Runtime: a conversation's layers, the tree, pool gauges.

A mixin of Runtime, kept apart from the code that changes state.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from radix_ext.tree import NodeInfo


class RuntimeInspection:
    def describe(self, conversation_id: str, tokens: bool = False) -> dict:
        """Trace, canonical history, per-turn accounting and the chain."""
        conv = self.get(conversation_id)
        with self.engine.lock:
            chain_len = self.engine.tree.chain_tokens(conv.id)
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
                    "kv_device_bytes": chain_len * self.engine.bytes_per_token,
                    "kv_host_bytes": self.engine.host.bytes_of(conv.id),
                },
                "offload": conv.offload.mode,
            }
            if tokens:
                out["chain"]["token_ids"] = list(conv.chain_tokens)
        return out

    def tree_snapshot(self, conversation: Optional[str] = None) -> list[NodeInfo]:
        if conversation is not None:
            self.get(conversation)
        with self.engine.lock:
            return (self.engine.tree.snapshot(preview=self.tokenizer.decode, owner=conversation,
                                              both=self.engine.both_nodes())
                    + self.engine.host_nodes(self.tokenizer.decode, owner=conversation))

    def chains(self) -> dict[str, int]:
        """Tokens each conversation's chain holds in the tree."""
        with self.engine.lock:
            return {cid: self.engine.tree.chain_tokens(cid) for cid in list(self.conversations)}

    def gauges(self) -> dict[str, float]:
        """Pool usage for /metrics."""
        with self.engine.lock:
            tree, pools = self.engine.tree, self.engine.pools
            return {
                "pool_capacity_tokens": pools.capacity,
                "pool_free_tokens": pools.allocator.available_size(),
                "tree_locked_tokens": tree.protected_size(),
                "tree_evictable_tokens": tree.evictable_size(),
                "conversations": len(self.conversations),
                "materialized_total": self.materializer.stats["done"],
                "materialize_cancelled_total": self.materializer.stats["cancelled"],
                "materialize_joined_total": self.materializer.stats["joined"],
                "host_capacity_tokens": self.engine.host.capacity_tokens,
                "host_used_tokens": self.engine.host.used_tokens,
                **{f"offload_{k}": v for k, v in dataclasses.asdict(self.engine.host.stats).items()},
            }
