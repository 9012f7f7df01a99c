"""The commands the `session` tree answers at intake (`control.py` says how
they travel): each a method `_cmd_NAME(args, scheduler)` that validates all
of `args` before it changes anything, and raises BadCommand or StaleCommand.
A mixin of SchedulerSessionCache; it runs on the scheduler's thread, between
batches."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from radix_ext.sglang.control import BadCommand, StaleCommand, answer, refusal
from radix_ext.sglang.hints import RIDING, command_of
from radix_ext.tree import Namespace

BACKEND_NAME = "session"
MAX_BATCH = 4096  # commands in one `batch`


class Commands:
    def handlers(self) -> dict:
        return {
            "ping": self._cmd_ping, "pools": self._cmd_pools, "probe": self._cmd_probe,
            "probe_many": self._cmd_probe_many,
            "hold_prefix": self._cmd_hold_prefix, "release": self._cmd_release, "idle": self._cmd_idle,
            "wait": self._cmd_wait, "demote": self._cmd_demote, "promote": self._cmd_promote, "host": self._cmd_host,
            "snapshot": self._cmd_snapshot, "check": self._cmd_check, "close": self._cmd_close,
            "renew": self._cmd_renew, "adopt": self._cmd_adopt, "batch": self._cmd_batch,
        }

    def _cmd_batch(self, args: dict, scheduler: Any) -> list:
        """Commands of RIDING that waited for their conversations' next steps in
        vain, sent together (session_runtime/backends/sglang/after.py): each runs
        in order and answers on its own; one that fails stops none after it."""
        commands = args.get("commands")
        if not isinstance(commands, list) or len(commands) > MAX_BATCH:
            raise BadCommand(f"batch: 'commands' is a list of at most {MAX_BATCH} commands")
        handlers = self.commands
        return [answer(handlers, c.get("cmd"), c.get("args"), scheduler)
                if isinstance(c, dict) and c.get("cmd") in RIDING
                else refusal(f"a batch carries only {sorted(RIDING)} commands") for c in commands]

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
            "leases": {"holders": len(self.leases.until), "chains": len(self.leases.holder_of),
                       "expired_chains": self.leases.expired_chains},
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

    def _cmd_renew(self, args: dict, scheduler: Any) -> dict:
        """The holder's heartbeat: its chains' lease runs `lease_s` from now."""
        holder, lease = _holder(args), _lease(args)
        return {"chains": self.leases.renew(holder, lease)}

    def _cmd_adopt(self, args: dict, scheduler: Any) -> dict:
        """A runtime connects: the chains of `keep` (the conversations it knows)
        are held under its lease from now on; every other chain is released
        (`release`, default true: a fleet member's peers' are theirs), but for
        those another runtime holds under a live lease. With `host_tokens`,
        the host tier is allocated now, before any step needs it."""
        holder, lease = _holder(args), _lease(args, zero_ok=True)  # 0: kept without a lease
        keep = args.get("keep")
        if not isinstance(keep, list) or not all(isinstance(o, str) for o in keep):
            raise BadCommand("keep must be a list of conversation ids")
        release = args.get("release", True)
        if not isinstance(release, bool):
            raise BadCommand("release must be a boolean")
        if "host_tokens" in args:
            self.offload.ensure(self, _host_tokens(args))
        keep_set = set(keep)
        stray = [o for o in self.chains if release and o not in keep_set and not self.leases.live(o)]
        for owner in stray:
            self.offload.forget(owner)
            self.release_chain(owner)
        kept = [o for o in self.chains if o in keep_set]
        self.leases.adopt(holder, lease, kept)
        return {"released": len(stray), "adopted": len(kept)}

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
        return {**got, "shared": shared, "on_host": self.offload.holds(owner)}

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
        """The tree's nodes (or `owner`'s chain's), parents first, then those of
        tails on the host tier (residency "host")."""
        owner = args.get("owner")
        if owner is not None and not isinstance(owner, str):
            raise BadCommand("owner must be a string")
        preview = args.get("preview_tokens", 16)
        if not isinstance(preview, int) or not 0 <= preview <= 256:
            raise BadCommand("preview_tokens must be an integer in [0, 256]")
        nodes = self.snapshot(preview=list, owner=owner, preview_tokens=preview)
        # A tail moved to the host tier (a tool wait, an idle chain) left the tree: its nodes are listed as "host".
        nodes += self.offload.nodes(self, preview=list, owner=owner, preview_tokens=preview)
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


def _holder(args: dict) -> str:
    holder = args.get("holder")
    if not isinstance(holder, str) or not 0 < len(holder) <= 128:
        raise BadCommand("holder must be a non-empty string of at most 128 characters")
    return holder


def _lease(args: dict, zero_ok: bool = False) -> float:
    lease = args.get("lease_s")
    if not isinstance(lease, (int, float)) or isinstance(lease, bool) or not 0 <= lease <= 86400 \
            or lease == 0 and not zero_ok:
        raise BadCommand(f"lease_s must be a number in {'[' if zero_ok else '('}0, 86400]")
    return float(lease)


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


def _running(scheduler: Any) -> int:
    """Requests the scheduler holds: waiting, running or in its last batch
    (command requests aside: they hold nothing of the tree)."""
    if scheduler is None:
        return 0
    reqs = list(getattr(scheduler, "waiting_queue", ()) or ())
    for batch in (getattr(scheduler, "running_batch", None), getattr(scheduler, "last_batch", None)):
        reqs += list(getattr(batch, "reqs", ()) or ()) if batch is not None else []
    return sum(1 for r in reqs if command_of(getattr(r, "kv_hints", None)) is None)


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
