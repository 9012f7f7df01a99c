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

import dataclasses
import logging
import time
from typing import Any, Optional

import torch
from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams, MatchResult
from sglang.srt.mem_cache.cache_init_params import CacheInitParams

from radix_ext.sglang.control import BadCommand, StaleCommand, answer
from radix_ext.sglang.hints import command_of, has_chain_action, intent_of
from radix_ext.sglang.report import Reports, attach
from radix_ext.sglang.idle import IdleChains, short
from radix_ext.sglang.offload import SchedulerHostTier
from radix_ext.tails import common_length, page_of
from radix_ext.tree import Namespace, SessionRadixCache

logger = logging.getLogger(__name__)

BACKEND_NAME = "session"


class SchedulerSessionCache(SessionRadixCache):
    """The tree SGLang's scheduler uses, with conversations' chains, and the
    commands and per-request reports that reach it through SGLang's requests."""

    def __init__(self, params: CacheInitParams):
        super().__init__(params)
        self._offers: dict[str, str] = {}  # owner -> rid of the request its private page is offered to
        self._kept: dict[int, tuple[int, Any]] = {}  # id(req.kv) -> (position, tail) kept at finish
        self.idle = IdleChains()
        self.offload = SchedulerHostTier()
        self.reports = Reports()  # rid -> what intake found for it (a command's answer, a step's probes)
        self.commands = self.handlers()

    # ----- intake (the plugin's hook, every rank, between batches) --------------

    def intake(self, scheduler: Any, recv_reqs) -> None:
        """Before the scheduler processes what it received (every rank receives
        the same list): answer the commands, and run the steps' pre-actions
        (counterfactual probes, promotion from the host, the logical probe) on
        the tree as it is now. The answers wait for their requests' release."""
        for recv in recv_reqs or ():
            for req in getattr(recv, "batch", None) or (recv,):
                hints = getattr(req, "kv_hints", None)
                if hints is None or getattr(req, "rid", None) is None:
                    continue
                cmd = command_of(hints)
                if cmd is not None:
                    self.reports.put(req.rid, answer(self.commands, cmd[0], cmd[1], scheduler))
                    continue
                owner, intent = getattr(req, "session_id", None), intent_of(hints)
                if owner and (intent.promote or intent.probes):
                    try:
                        self.reports.put(req.rid, self._before(owner, intent, req))
                    except Exception as exc:  # never into SGLang's loop: the step runs, its report says why
                        logger.exception("pre-actions of %s failed", req.rid)
                        self.reports.put(req.rid, {"error": f"{type(exc).__name__}: {exc}"})

    def _before(self, owner: str, intent, req) -> dict:
        ns = Namespace(getattr(req, "extra_key", None), getattr(req, "cache_salt", None) or None)
        ids = list(req.input_ids or ())
        probes = []
        for shared, tail in intent.probes:
            tokens = ids[:shared] + list(tail)
            r = self.probe(ns.key(tokens[: max(len(tokens) - 1, 0)]))
            probes.append([r.logical_len, r.device_len])
        promoted = {"anchor": 0, "tokens": 0}
        if intent.promote:
            promoted = self._cmd_promote({"owner": owner, "tokens": ids, "share": intent.share,
                                          "extra_key": ns.extra_key, "cache_salt": ns.cache_salt}, None)
        logical = self.probe(ns.key(ids[: max(len(ids) - 1, 0)])).logical_len
        return {"probes": probes, "promoted": promoted, "logical_len": logical}

    # ----- per-request hooks (called by SGLang's scheduler) -------------------

    def match_prefix(self, params: MatchPrefixParams) -> MatchResult:
        """The tree's page-aligned match, extended by the private page of the
        request's conversation when the request continues it."""
        result = super().match_prefix(params)
        req = params.req
        owner = getattr(req, "session_id", None) if req is not None else None
        if owner:
            self.idle.active(owner)  # a request of its own is waiting: not idle
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
        report = self.reports.pop(getattr(req, "rid", None))
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
        if intent_of(hints).hold:
            # last_node is the checkpoint's tail, still in the tree: the request's
            # lock was dropped a moment ago, on this thread, with nothing between.
            self.set_chain(owner, req.last_node, tail)
        else:
            self.release_chain(owner)

    def _chain_report(self, owner: str) -> dict:
        """What a step's answer says about its chain and the pool after it."""
        alloc = self.token_to_kv_pool_allocator
        return {"chain_tokens": self.chain_tokens(owner), "private": owner in self.tails,
                "host_bytes": self.offload.bytes_of(owner), "on_host": self._on_host(owner),
                "free_fraction": (alloc.available_size() + self.evictable_size()) / max(self.capacity, 1)}

    def _on_host(self, owner: str) -> bool:
        host = self.offload.host
        return host is not None and host.peek(owner) is not None

    def release_chain(self, owner: str) -> None:
        super().release_chain(owner)
        if hasattr(self, "idle"):
            self.idle.active(owner)

    def relieve(self, scheduler: Any) -> None:
        """Once per scheduler iteration: under pressure demote conversations that
        wait for tools first, then retire idle chains (past their TTL, or in the way)."""
        if self.offload.waiting and short(self, scheduler):
            self.offload.relieve(self, lambda: short(self, scheduler))
        self.idle.relieve(self, scheduler)

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
        for name in ("chains", "tails", "_offers", "_kept", "reports"):
            if hasattr(self, name):
                getattr(self, name).clear()
        if hasattr(self, "offload"):
            self.offload.waiting.clear()  # host copies hang from chains that are gone: dropped at promote

    # ----- control commands (run on the scheduler thread, between batches) ---

    def handlers(self) -> dict:
        return {
            "ping": self._cmd_ping, "pools": self._cmd_pools, "probe": self._cmd_probe,
            "probe_many": self._cmd_probe_many,
            "hold_prefix": self._cmd_hold_prefix, "release": self._cmd_release, "idle": self._cmd_idle,
            "wait": self._cmd_wait, "demote": self._cmd_demote, "promote": self._cmd_promote, "host": self._cmd_host,
            "snapshot": self._cmd_snapshot, "check": self._cmd_check, "close": self._cmd_close,
        }

    def _cmd_ping(self, args: dict, scheduler: Any) -> dict:
        import sglang

        return {"backend": BACKEND_NAME, "page_size": self.page_size, "capacity": self.capacity,
                "sglang": sglang.__version__, "tp_size": getattr(scheduler, "tp_size", 1) or 1}

    def _cmd_pools(self, args: dict, scheduler: Any) -> dict:
        return {
            "capacity": self.capacity,
            "available": self.token_to_kv_pool_allocator.available_size(),
            "evictable": self.evictable_size(), "protected": self.protected_size(),
            "chains": {owner: self.chain_tokens(owner) for owner in self.chains},
            "private": self.private_tokens(),
            "idle": sorted(self.idle.since), "idle_stats": dict(self.idle.stats),
            "host": self.offload.stats(),
            "running": _running(scheduler),
        }

    def _cmd_probe(self, args: dict, scheduler: Any) -> dict:
        result = self.probe(_key(args))
        return {"logical_len": result.logical_len, "device_len": result.device_len}

    def _cmd_probe_many(self, args: dict, scheduler: Any) -> list:
        prompts = args.get("prompts")
        if not isinstance(prompts, list) or len(prompts) > 64:
            raise BadCommand("prompts must be a list of at most 64 token lists")
        keys = [_key({**args, "tokens": p}) for p in prompts]  # validate all before reading any
        return [{"logical_len": r.logical_len, "device_len": r.device_len} for r in map(self.probe, keys)]

    def _cmd_hold_prefix(self, args: dict, scheduler: Any) -> dict:
        """Move the owner's chain to the longest cached page-aligned prefix of
        `tokens` (a turn's fork point): the branch past it is no longer held."""
        owner = _owner(args)
        self._check_expected(owner, args)
        self._offers.pop(owner, None)
        free_branch = args.get("free_branch", False)
        if not isinstance(free_branch, bool):
            raise BadCommand("free_branch must be a boolean")
        return {"tokens": self.hold_prefix(owner, _key(args), free_branch=free_branch)}

    def _cmd_idle(self, args: dict, scheduler: Any) -> dict:
        """The owner's turn closed: its chain is idle until its next request
        (retired after `ttl_s`, 0 = only under pressure; `relieve`). With
        `host_tokens`, the host tier it may be demoted to is allocated."""
        owner = _owner(args)
        ttl = _ttl(args)
        if "host_tokens" in args:
            self.offload.ensure(self, _host_tokens(args))
        if owner in self.chains:
            self.idle.mark(owner, float(ttl))
        return {"idle": owner in self.idle.since}

    def _cmd_close(self, args: dict, scheduler: Any) -> dict:
        """A turn closed: hold the owner's chain at its fork (`tokens`, when
        given; `free_branch` as hold_prefix), mark it idle (`ttl_s`, when given),
        and report the chain and the pool: one command for the whole close."""
        owner = _owner(args)
        free_branch = args.get("free_branch", False)
        if not isinstance(free_branch, bool):
            raise BadCommand("free_branch must be a boolean")
        key = _key(args) if "tokens" in args else None
        idle = {k: args[k] for k in ("ttl_s", "host_tokens") if k in args}
        if "ttl_s" in args:
            _ttl(args)
        if "host_tokens" in args:
            _host_tokens(args)
        if key is not None:  # everything checked: now change the tree
            self._offers.pop(owner, None)
            self.hold_prefix(owner, key, free_branch=free_branch)
        if "ttl_s" in idle:
            self._cmd_idle({"owner": owner, **idle}, scheduler)
        report = self._chain_report(owner)
        return {"tokens": report["chain_tokens"], "host_bytes": report["host_bytes"],
                "free_fraction": report["free_fraction"]}

    def _cmd_wait(self, args: dict, scheduler: Any) -> dict:
        """The owner waits for tools: pressure may demote it (allocates the host
        tier of `host_tokens` on first use)."""
        owner = _owner(args)
        self.offload.ensure(self, _host_tokens(args))
        if owner in self.chains:
            self.offload.waiting[owner] = time.monotonic()
        return {"waiting": owner in self.offload.waiting}

    def _cmd_demote(self, args: dict, scheduler: Any) -> dict:
        owner = _owner(args)
        self.offload.ensure(self, _host_tokens(args))
        copy = args.get("copy", True)
        if not isinstance(copy, bool):
            raise BadCommand("copy must be a boolean")
        moved = self.offload.demote(self, owner)
        if moved and not copy:  # discard (baseline): the next step recomputes it
            self.offload.forget(owner)
        return {"tokens": moved}

    def _cmd_promote(self, args: dict, scheduler: Any) -> dict:
        """The owner's own host copy comes back for its next request; else, with
        `share`, another conversation's that the request's prompt continues."""
        owner, key = _owner(args), _key(args)
        share = args.get("share", False)
        if not isinstance(share, bool):
            raise BadCommand("share must be a boolean")
        got = self.offload.promote(self, owner, key)
        shared = not got["tokens"] and share
        if shared:
            got = self.offload.share(self, owner, key)
        host = self.offload.host
        return {**got, "shared": shared, "on_host": host is not None and host.peek(owner) is not None}

    def _cmd_host(self, args: dict, scheduler: Any) -> dict:
        return {"bytes": self.offload.bytes_of(_owner(args)), **self.offload.stats()}

    def _cmd_release(self, args: dict, scheduler: Any) -> dict:
        owner = _owner(args)
        self._check_expected(owner, args)
        held = owner in self.chains
        self.release_chain(owner)
        self.offload.forget(owner)
        return {"released": held}

    def _cmd_snapshot(self, args: dict, scheduler: Any) -> dict:
        owner = args.get("owner")
        if owner is not None and not isinstance(owner, str):
            raise BadCommand("owner must be a string")
        preview = args.get("preview_tokens", 16)
        if not isinstance(preview, int) or not 0 <= preview <= 256:
            raise BadCommand("preview_tokens must be an integer in [0, 256]")
        nodes = self.snapshot(preview=list, owner=owner, preview_tokens=preview)
        return {"nodes": [dataclasses.asdict(n) for n in nodes]}

    def _cmd_check(self, args: dict, scheduler: Any) -> dict:
        """Tree invariants always; the pool equation and stray locks only when
        the scheduler holds no request (then nothing is in flight)."""
        idle = _running(scheduler) == 0
        self.check_integrity(in_flight_tokens=0 if idle else None, in_flight_locks=0 if idle else None)
        if self.offload.host is not None:
            self.offload.host.check()
        digest = self.digest()
        ranks = same_on_every_rank(scheduler, digest)
        return {"checked": "full" if idle else "tree", "chains": len(self.chains), "ranks": ranks,
                "digest": digest}

    def digest(self) -> str:
        """A hash of the tree's shape, chains and private pages (not of slot
        numbers, which differ between ranks)."""
        import hashlib

        h = hashlib.sha256()
        for n in self.snapshot(preview=list, preview_tokens=8):
            h.update(repr((n.depth_tokens, n.tokens, n.preview, sorted(n.owners), n.lock_count, n.residency,
                           n.namespace, n.cache_salt)).encode())
        for owner in sorted(self.chains):
            h.update(repr((owner, self.chain_tokens(owner))).encode())
        return h.hexdigest()[:16]

    def _check_expected(self, owner: str, args: dict) -> None:
        expect = args.get("expect_tokens")
        if expect is None:
            return
        if not isinstance(expect, int):
            raise BadCommand("expect_tokens must be an integer")
        have = self.chain_tokens(owner)
        if have != expect:
            raise StaleCommand(f"chain of {owner!r} holds {have} tokens, the command expected {expect}")


def _owner(args: dict) -> str:
    owner = args.get("owner")
    if not isinstance(owner, str) or not owner:
        raise BadCommand("owner must be a non-empty string")
    return owner


def _ttl(args: dict) -> float:
    ttl = args.get("ttl_s", 0)
    if not isinstance(ttl, (int, float)) or isinstance(ttl, bool) or ttl < 0:
        raise BadCommand("ttl_s must be a number >= 0")
    return ttl


def _host_tokens(args: dict) -> int:
    tokens = args.get("host_tokens")
    if not isinstance(tokens, int) or isinstance(tokens, bool) or not 0 <= tokens <= 1 << 26:
        raise BadCommand("host_tokens must be an integer in [0, 2**26]")
    return tokens


def _key(args: dict):
    tokens = args.get("tokens")
    if not isinstance(tokens, list) or not all(isinstance(t, int) and t >= 0 for t in tokens):
        raise BadCommand("tokens must be a list of non-negative integers")
    ns = {k: args.get(k) for k in ("extra_key", "cache_salt")}
    if any(v is not None and not isinstance(v, str) for v in ns.values()):
        raise BadCommand("extra_key and cache_salt must be strings or null")
    return Namespace(**ns).key(tokens)


def _aborted(req) -> bool:
    reason = getattr(req, "finished_reason", None)
    return reason is not None and type(reason).__name__ == "FINISH_ABORT"


def _running(scheduler: Any) -> int:
    """Requests the scheduler holds: waiting, running or in its last batch
    (command requests aside: they hold nothing of the tree)."""
    if scheduler is None:
        return 0
    reqs = list(getattr(scheduler, "waiting_queue", ()) or ())
    for batch in (getattr(scheduler, "running_batch", None), getattr(scheduler, "last_batch", None)):
        reqs += list(getattr(batch, "reqs", ()) or ()) if batch is not None else []
    return sum(1 for r in reqs if command_of(getattr(r, "kv_hints", None)) is None)


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
    cache = SchedulerSessionCache(ctx.params)
    logger.info("session radix cache: page size %d, eviction %s, tp size %d; commands ride requests",
                cache.page_size, ctx.params.eviction_policy, ctx.tp_size)
    return cache


def same_on_every_rank(scheduler: Any, digest: str) -> int:
    """The number of tensor-parallel ranks; AssertionError when their trees'
    digests differ. Every rank runs a command in the same iteration (intake),
    so a collective over the scheduler's TP CPU group is safe here."""
    group, size = getattr(scheduler, "tp_cpu_group", None), getattr(scheduler, "tp_size", 1) or 1
    if group is None or size <= 1:
        return 1
    import torch.distributed as dist

    digests: list = [None] * size
    dist.all_gather_object(digests, digest, group=group)
    assert len(set(digests)) == 1, f"the ranks' trees differ: digests {digests}"
    return size
