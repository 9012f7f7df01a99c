"""The KV slots one running step of the embedded engine uses (engine.py): the
reused prefix (the tree's pages, then the head of the chain's private page if
the step took it) plus the pages it allocates as it goes, freed again if it
fails before its commit, or inserted into the tree as the owner's chain by it.
`engine`: the Engine, whose tree, pools, host tier and allocation it uses."""

from __future__ import annotations

import torch


class SlotBuffer:
    """Slots a running step uses: the reused prefix (the tree's pages, then the
    head of the chain's private page if the step took it) plus pages it allocates."""

    def __init__(self, engine, node, prefix: torch.Tensor, tail=None):
        self.engine = engine
        self.node = node  # the matched prefix's last node, locked for the step
        self.page_start = len(prefix)  # first position of the step's own pages
        self.tail = tail  # the private page taken from the chain, or None
        self.prefix_len = len(prefix) + (len(tail.tokens) if tail is not None else 0)  # reused
        self.slots = prefix if tail is None else torch.cat((prefix, tail.page))
        self.committed = False  # the tree owns the slots now: a late error must not free them

    def ensure(self, total: int) -> None:
        """Make slots cover positions [0, total), allocating whole pages."""
        missing = total - len(self.slots)
        if missing <= 0:
            return
        new = self.engine.alloc(missing)
        self.slots = torch.cat((self.slots, new))

    def release(self, owner: str) -> None:
        """The step failed: free the pages it allocated, give the private page back."""
        first = self.page_start + (self.engine.page_size if self.tail is not None else 0)
        self.engine.pools.allocator.free(self.slots[first:])
        if self.tail is not None:
            self.engine.tree.return_tail(owner, self.node, self.tail)

    def commit(self, req, computed: list[int]) -> int:
        """Insert the computed sequence (or only the prompt), free duplicates, keep
        the partial last page as the chain's private page (or free it) and move
        the owner's chain lock. Returns the tokens the chain (or, for a step that
        holds none, the tree) now has for this sequence."""
        ps = self.engine.page_size
        cached_upto = len(computed) if req.cache_output else len(req.prompt)
        aligned = cached_upto // ps * ps
        key = req.namespace.key(computed[:aligned])
        slots = self.slots
        node, prefix_len = self.engine.tree.insert_sequence(key, slots[:aligned])
        allocator = self.engine.pools.allocator
        start = self.page_start  # page aligned, <= aligned
        # Pages [start, prefix_len) duplicate KV the tree already had.
        if prefix_len > start:
            allocator.free(slots[start:prefix_len])
        tail = None
        if req.hold_chain and cached_upto > aligned:
            tail = self.engine.tree.make_tail(computed[aligned:cached_upto], slots[aligned : aligned + ps])
        allocator.free(slots[aligned + (ps if tail is not None else 0) :])
        if req.hold_chain:
            self.engine.tree.set_chain(req.owner, node, tail)
        else:
            self.engine.tree.release_chain(req.owner)
        self.engine.host.forget_evicted(req.owner)  # recomputed, if it had lost its tail
        # Drop the step's own lock on its matched prefix (taken in match_and_lock).
        self.engine.tree.dec_lock_ref(self.node)
        self.committed = True
        return aligned + (len(tail.tokens) if tail is not None else 0)
