"""SessionRadixCache as SGLang's `session` radix-cache backend.

Inside the scheduler, a request that names a conversation (`session_id`)
leaves that conversation's chain locked at its new tail when it finishes:
the scheduler checkpoints the request into the tree as usual, drops the
request's own lock in `release_kv_cache`, then calls `on_release`, where the
chain lock moves (the path stays locked all along, so nothing in between can
evict it). The chain outlives the request; only a control command (the
runtime saying so) releases it or moves it back to a fork point.

Chains are tree locks, so they count in `protected_size()`: the scheduler's
idle check (available + evictable + protected = total) holds, and the queries
its idle loop makes thousands of times a second stay O(1) counters.

Private partial pages (`radix_ext/tails.py`): when a request that holds its
conversation's chain finishes, the page past its last full one is kept for the
chain instead of freed (`checkpoint` notes it, `free_kv_row` leaves it out,
`on_release` attaches it). The conversation's next request matches it
(`match_prefix` offers it, with the protected length still page aligned) and
takes it at allocation (`prefix_device_indices`): the scheduler's paged
allocator continues a non-aligned prefix inside its last page, so the request
writes the rest of that page and recomputes nothing. Private pages count in
`protected_size()`, so the idle check still adds up.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch
from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams, MatchResult
from sglang.srt.mem_cache.cache_init_params import CacheInitParams

from radix_ext.sglang.commands import BACKEND_NAME, Commands  # noqa: F401  (the plugin registers it by name)
from radix_ext.sglang.control import answer, refusal
from radix_ext.sglang.hints import command_of, has_chain_action, intent_of
from radix_ext.sglang.report import Reports, attach
from radix_ext.sglang.idle import IdleChains, short
from radix_ext.sglang.leases import Leases
from radix_ext.sglang.offload import SchedulerHostTier
from radix_ext.sglang.pressure import busy_owners, make_room, touch
from radix_ext.kv_layout import UnsupportedLayout, layout_of
from radix_ext.tails import common_length, page_of
from radix_ext.tree import Namespace, SessionRadixCache

logger = logging.getLogger(__name__)


class SchedulerSessionCache(Commands, SessionRadixCache):
    """The tree SGLang's scheduler uses, with conversations' chains, and the
    commands and per-request reports that reach it through SGLang's requests."""

    def __init__(self, params: CacheInitParams):
        super().__init__(params)
        self._offers: dict[str, str] = {}  # owner -> rid of the request its private page is offered to
        self._kept: dict[int, tuple[int, Any]] = {}  # id(req.kv) -> (position, tail) kept at finish
        self.idle = IdleChains()
        self.offload = SchedulerHostTier()
        self.reports = Reports()  # rid -> what intake found for it (a command's answer, a step's probes)
        self.leases = Leases()
        self._answered: set[str] = set()  # command requests answered at intake, to finish unrun
        self.commands = self.handlers()
        self.used_at: dict[str, float] = {}  # owner -> when a step last held its chain (pressure.py)
        self._scheduler: Any = None  # the scheduler this tree serves, seen at intake

    # ----- intake (the plugin's hook, every rank, between batches) --------------

    def intake(self, scheduler: Any, recv_reqs) -> None:
        """Before the scheduler processes what it received (every rank receives
        the same list): answer the commands, and run the steps' pre-actions
        (counterfactual probes, promotion from the host, the logical probe) on
        the tree as it is now. The answers wait for their requests' release."""
        self._scheduler = scheduler
        for recv in recv_reqs or ():
            for req in getattr(recv, "batch", None) or (recv,):
                hints = getattr(req, "kv_hints", None)
                if hints is None or getattr(req, "rid", None) is None:
                    continue
                cmd = command_of(hints)
                if cmd is not None:
                    self.reports.put(req.rid, answer(self.commands, cmd[0], cmd[1], scheduler))
                    self._answered.add(req.rid)
                    continue
                owner, intent = getattr(req, "session_id", None), intent_of(hints)
                if owner and has_chain_action(hints):
                    # What rode the step (its conversation's previous close or tool wait) runs first.
                    # Only the step's own conversation's.
                    riding = [answer(self.commands, name, args, scheduler) if args.get("owner") == owner
                              else refusal(f"a command riding a step of {owner!r} is for that conversation only")
                              for name, args in intent.before]
                    try:
                        report = self._before(owner, intent, req)
                    except Exception as exc:  # never into SGLang's loop: the step runs, its report says why
                        logger.exception("pre-actions of %s failed", req.rid)
                        report = {"error": f"{type(exc).__name__}: {exc}"}
                    self.reports.put(req.rid, {**report, "before": riding} if riding else report)

    def finish_commands(self, scheduler: Any) -> None:
        """After the scheduler queued what it received (every rank): the command
        requests answered at intake leave the queue and finish at once, with
        their answers, without running the model (as SGLang finishes a request
        it rejects at intake: `stream_output` of an unrun request)."""
        if not self._answered:
            return
        answered, self._answered = self._answered, set()
        queue = getattr(scheduler, "waiting_queue", None)
        if queue is None:
            return
        done = [r for r in queue if getattr(r, "rid", None) in answered]
        if not done:
            return
        queue[:] = [r for r in queue if getattr(r, "rid", None) not in answered]
        from sglang.srt.managers.schedule_batch import FINISH_LENGTH

        for req in done:
            attach(req, self.reports.pop(req.rid))
            req.finished_reason = FINISH_LENGTH(length=0)
        try:
            scheduler.output_streamer.stream_output(done, False)
        except Exception:  # never into SGLang's loop: let them run as requests, their answers attached
            logger.exception("finishing %d command requests unrun failed; they run instead", len(done))
            for req in done:
                req.finished_reason = None
            queue.extend(done)

    def _before(self, owner: str, intent, req) -> dict:
        ns = Namespace(getattr(req, "extra_key", None), getattr(req, "cache_salt", None) or None)
        ids = list(req.input_ids or ())
        def probe(tokens: list[int]):  # the last token is always computed for its logits
            return self.probe(ns.key(tokens[: max(len(tokens) - 1, 0)]))

        probes = [[r.logical_len, r.device_len] for r in (probe(ids[:shared] + list(tail))
                                                          for shared, tail in intent.probes)]
        promoted = {"anchor": 0, "tokens": 0}
        if intent.promote:
            promoted = self._cmd_promote({"owner": owner, "tokens": ids, "share": intent.share,
                                          "extra_key": ns.extra_key, "cache_salt": ns.cache_salt}, None)
        return {"probes": probes, "promoted": promoted, "logical_len": probe(ids).logical_len,
                "host_bytes": self.offload.bytes_of(owner), "free_fraction": self.free_fraction()}

    # ----- per-request hooks (called by SGLang's scheduler) -------------------

    def match_prefix(self, params: MatchPrefixParams) -> MatchResult:
        """The tree's page-aligned match, extended by the private page of the
        request's conversation when the request continues it."""
        result = super().match_prefix(params)
        req = params.req
        owner = getattr(req, "session_id", None) if req is not None else None
        if owner:
            self.idle.active(owner)  # a request of its own is waiting: not idle
        if req is not None and getattr(req, "session_report", None) is None:
            found = self.reports.pop(getattr(req, "rid", None))
            if found is not None:  # what intake found rides the request's first chunk
                req.session_report = found
                attach(req, found)
        if (not owner or self.page_size == 1 or getattr(params.key, "is_bigram", False)
                or not has_chain_action(getattr(req, "kv_hints", None))):
            return result
        tail, node = self.tails.get(owner), result.last_device_node
        if tail is None or self.chains.get(owner) is not node or self._offers.get(owner, req.rid) != req.rid:
            return result
        aligned = result.device_prefix_len
        k = common_length(tail.tokens, params.key.token_ids, aligned, len(params.key))
        if k == 0:
            return result
        self._offers[owner] = req.rid  # one request at a time may write into the page
        return result._replace(device_prefix_len=aligned + k, cache_protected_len=aligned)

    def prefix_device_indices(self, req) -> torch.Tensor:
        path = self.path_device_indices(req.last_node)
        extra = req.prefix_len - len(path)
        if extra <= 0:
            return path[: req.prefix_len]
        # Allocation: the request takes the private page (it writes the rest of it).
        owner = req.session_id
        assert self._offers.pop(owner, None) == req.rid, f"private page of {owner} not offered to {req.rid}"
        tail = self.tails.pop(owner)
        assert self.chains.get(owner) is req.last_node and extra <= len(tail.tokens)
        return torch.cat((path, tail.page[:extra].to(path.dtype)))

    def checkpoint(self, req, *, up_to: int, **kwargs):
        # A prompt-only step (SGLang's --strip-thinking-cache, per request)
        # inserts only its prompt; the slots past the tree-owned part are freed
        # by release_kv_cache.
        intent = intent_of(getattr(req, "kv_hints", None))
        if intent.cache_limit is not None:
            up_to = min(up_to, intent.cache_limit)
        out = super().checkpoint(req, up_to=up_to, **kwargs)
        aligned = req.kv.cache_protected_len
        if (intent.hold and intent.cache_limit is None and getattr(req, "session_id", None) and req.finished()
                and not _aborted(req) and self.page_size > 1 and 0 < up_to - aligned < self.page_size):
            row = self.req_to_token_pool.req_to_token[req.kv.req_pool_idx]
            page = page_of(row[aligned : aligned + 1].to(torch.int64), self.page_size)
            self._kept[id(req.kv)] = (aligned, self.make_tail(req.full_untruncated_fill_ids[aligned:up_to], page))
        return out

    def free_kv_row(self, kv, ranges: list[tuple[int, int]]) -> None:
        kept = self._kept.get(id(kv))
        if kept is not None:  # the private page is not the row's to free
            lo, hi = kept[0], kept[0] + self.page_size
            pieces = []
            for s, e in ranges:
                pieces += [(s, min(e, lo)), (max(s, hi), e)] if s < hi and lo < e else [(s, e)]
            ranges = [(s, e) for s, e in pieces if s < e]
        super().free_kv_row(kv, ranges)

    def on_release(self, req, *, checkpointed: bool) -> None:
        owner = getattr(req, "session_id", None)
        hints = getattr(req, "kv_hints", None)
        report = getattr(req, "session_report", None) or self.reports.pop(getattr(req, "rid", None))
        try:
            self._release_request(req, owner, hints, checkpointed)
        finally:
            if owner and has_chain_action(hints):
                report = {**(report or {}), **self._chain_report(owner)}
            if report is not None:
                attach(req, report)

    def _release_request(self, req, owner: Optional[str], hints: Any, checkpointed: bool) -> None:
        kept = self._kept.pop(id(getattr(req, "kv", None)), None)
        tail = kept[1] if kept is not None else None
        if owner in self._offers and self._offers[owner] == getattr(req, "rid", None):
            del self._offers[owner]
        if not owner or not checkpointed or req.last_node is None or _aborted(req) or not has_chain_action(hints):
            if tail is not None:
                self.token_to_kv_pool_allocator.free(tail.page)
            return
        intent = intent_of(hints)
        if intent.hold:
            # last_node is the checkpoint's tail, still in the tree: the request's
            # lock was dropped a moment ago, on this thread, with nothing between.
            self.set_chain(owner, req.last_node, tail)
            self.leases.hold(owner, intent.holder, intent.lease_s)
        else:
            self.release_chain(owner)

    def _chain_report(self, owner: str) -> dict:
        """What a step's answer says about its chain and the pool after it."""
        return {"chain_tokens": self.chain_tokens(owner), "private": owner in self.tails,
                "host_bytes": self.offload.bytes_of(owner), "on_host": self.offload.holds(owner),
                "free_fraction": self.free_fraction()}

    def free_fraction(self) -> float:
        """Device slots free or evictable, over the pool."""
        return (self.token_to_kv_pool_allocator.available_size() + self.evictable_size()) / max(self.capacity, 1)

    def release_chain(self, owner: str) -> None:
        super().release_chain(owner)
        if hasattr(self, "idle"):
            self.idle.active(owner)
            self.leases.forget(owner)
            self.used_at.pop(owner, None)

    def relieve(self, scheduler: Any) -> None:
        """Once per scheduler iteration: under pressure demote conversations that
        wait for tools first, then retire idle chains (past their TTL, or in the way)."""
        for owner in self.leases.expired():  # its runtime is gone: back to the LRU
            logger.warning("the lease of %s's chain expired (its runtime stopped renewing it): released", owner)
            self.offload.forget(owner)
            self.release_chain(owner)
        self.idle.retire_due(self)
        if self.chains and short(self, scheduler):  # the queue's head waits for room that held chains keep
            make_room(self, lambda: not short(self, scheduler), busy_owners(scheduler))

    def evict_for_alloc(self, params, **kwargs):
        """SGLang's allocator is short (a prefill's or the next decode's slots;
        short there, a running request is retracted): held chains that no
        request uses make room first (pressure.py), then the LRU evicts."""
        alloc = self.token_to_kv_pool_allocator
        need = alloc.available_size() + params.num_tokens
        if self.chains and alloc.available_size() + self.evictable_size() < need:
            make_room(self, lambda: alloc.available_size() + self.evictable_size() >= need,
                      busy_owners(self._scheduler))
        return super().evict_for_alloc(params, **kwargs)

    def set_chain(self, owner: str, node, tail=None) -> None:
        super().set_chain(owner, node, tail)
        if hasattr(self, "used_at"):
            touch(self, owner)

    def finish(self, handle, outcome) -> None:
        super().finish(handle, outcome)
        rid = getattr(handle, "rid", None)
        for owner in [o for o, r in self._offers.items() if r == rid]:
            del self._offers[owner]

    def protected_size(self):
        # Private pages are neither free nor evictable: SGLang's idle check
        # (available + evictable + protected == total) counts them here.
        return super().protected_size() + self.private_tokens()

    def reset(self):
        # /flush_cache drops every node: the chains and private pages go with
        # them (the allocator is cleared right after).
        super().reset()
        for name in ("chains", "tails", "_offers", "_kept", "reports", "leases", "_answered", "used_at"):
            if hasattr(self, name):
                getattr(self, name).clear()
        if hasattr(self, "offload"):
            self.offload.waiting.clear()  # host copies hang from chains that are gone: dropped at promote

def _aborted(req) -> bool:
    reason = getattr(req, "finished_reason", None)
    return reason is not None and type(reason).__name__ == "FINISH_ABORT"


def build(ctx) -> SchedulerSessionCache:
    """Factory for `register_radix_cache_backend`: builds the cache from SGLang's
    TreeCacheBuildContext, with every cache parameter SGLang passes (page size,
    eviction policy, KV events, metrics) in `ctx.params`. Raises ValueError for
    model or server shapes a token-level session tree cannot serve."""
    if ctx.is_hybrid_swa or ctx.is_hybrid_ssm or ctx.is_dsa:
        raise ValueError("--radix-cache-backend session serves full-attention models only "
                         "(not hybrid sliding-window, SSM or DSA ones)")
    if ctx.enable_hierarchical_cache:
        raise ValueError("--radix-cache-backend session does not combine with --enable-hierarchical-cache")
    if ctx.disable_radix_cache:
        raise ValueError("--radix-cache-backend session needs the radix cache (drop --disable-radix-cache)")
    args = ctx.server_args
    if getattr(args, "dp_size", 1) > 1:
        raise ValueError("--radix-cache-backend session does not serve --dp-size > 1 yet: a command must reach "
                         "every rank, and SGLang routes a request to one data-parallel rank")
    try:  # at start, not at the first turn that forks inside a page
        layout = layout_of(ctx.params.token_to_kv_pool_allocator.get_kvcache())
    except UnsupportedLayout as exc:
        raise ValueError(f"--radix-cache-backend session cannot serve this model's KV cache: {exc}") from None
    cache = SchedulerSessionCache(ctx.params)
    logger.info("session radix cache: page size %d, eviction %s, tp size %d, KV layout %s; commands ride requests",
                cache.page_size, ctx.params.eviction_policy, ctx.tp_size, layout.name)
    return cache
