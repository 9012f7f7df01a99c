"""The SGLang-facing pieces without a server: the platform switch, the
kv_hints intent, the backend factory's refusals, the scheduler-side chain
hooks and the commands (through intake, release and the report, as a request
carries them), on a SchedulerSessionCache over real pools. (The same code
inside SGLang's real server: tests/backends/.)"""

from __future__ import annotations

import itertools
import threading
from importlib.metadata import entry_points
from types import SimpleNamespace

import pytest
import torch

from radix_ext.pools import PoolSpec, build_pools
from radix_ext.sglang import platform
from radix_ext.sglang.control import BadCommand, ChannelDown, ControlError, StaleCommand, result_of
from radix_ext.sglang.hints import ACTION_TYPE, ACTION_VERSION, NO_HOLD, ChainIntent, command_envelope, intent_of
from radix_ext.sglang.report import REPORT_KEY, attach, report_of

PAGE = 4


def test_entry_points_are_registered():
    assert [e.value for e in entry_points(group="sglang.srt.platforms") if e.name == "session_cpu"] == [
        "radix_ext.sglang.platform:activate"]
    assert [e.value for e in entry_points(group="sglang.srt.plugins") if e.name == "session_runtime"] == [
        "radix_ext.sglang.plugin:register"]


def test_platform_switches_on_only_when_asked(monkeypatch):
    monkeypatch.delenv(platform.ENV, raising=False)
    monkeypatch.delenv("SGLANG_PLATFORM", raising=False)
    assert platform.activate() is None
    monkeypatch.setenv(platform.ENV, "1")
    assert platform.activate() == "radix_ext.sglang.platform.SessionCpuPlatform"
    monkeypatch.delenv(platform.ENV)
    monkeypatch.setenv("SGLANG_PLATFORM", "session_cpu")
    assert platform.activate() is not None


def test_platform_class_is_sglangs_oot_cpu_platform():
    from sglang.srt.platforms.interface import PlatformEnum, SRTPlatform

    cls = platform.SessionCpuPlatform
    p = cls()
    assert isinstance(p, SRTPlatform) and cls._enum == PlatformEnum.OOT
    assert p.get_device() == "cpu" and p.get_dispatch_key_name() == "native"
    assert p.is_pin_memory_available() is False
    args = SimpleNamespace(attention_backend=None, sampling_backend="flashinfer")
    p.apply_server_args_defaults(args)
    assert (args.attention_backend, args.sampling_backend) == ("torch_native", "pytorch")


def _envelope(payload, version=ACTION_VERSION, action_type=ACTION_TYPE):
    from sglang.srt.managers.kv_hints import decode_kv_hints_envelope

    env = ChainIntent().envelope("m")
    env["actions"][0].update(payload=payload, action_version=version, action_type=action_type)
    return decode_kv_hints_envelope(env)


def test_intent_round_trips_through_sglangs_envelope():
    from sglang.srt.managers.kv_hints import decode_kv_hints_envelope

    for intent in (ChainIntent(), ChainIntent(hold=False), ChainIntent(cache_limit=40),
                   ChainIntent(promote=True, share=True, probes=((3, (7, 8)), (0, ()))),
                   ChainIntent(before=(("close", {"owner": "a", "tokens": [1, 2]}), ("wait", {"owner": "a"})))):
        assert intent_of(decode_kv_hints_envelope(intent.envelope("m1"))) == intent
    assert intent_of(None) == NO_HOLD  # a session_id without our hints holds nothing


@pytest.mark.parametrize("payload,version,action_type", [
    ({"hold": "yes"}, ACTION_VERSION, ACTION_TYPE),       # wrong type
    ({"hold": False, "extra": 1}, ACTION_VERSION, ACTION_TYPE),  # unknown field
    ({"cache_limit": -1}, ACTION_VERSION, ACTION_TYPE),   # negative limit
    ({"cache_limit": True}, ACTION_VERSION, ACTION_TYPE),  # a bool is not a count
    ({"probes": [[1]]}, ACTION_VERSION, ACTION_TYPE),      # a probe is [shared, tail]
    ({"probes": [[0, [1]]] * 5}, ACTION_VERSION, ACTION_TYPE),  # at most 4 probes
    ({"before": [{"cmd": "release", "args": {"owner": "a"}}]}, ACTION_VERSION, ACTION_TYPE),  # only close, wait
    ({"before": [{"cmd": "close"}]}, ACTION_VERSION, ACTION_TYPE),  # a command is {cmd, args}
    ({"before": [{"cmd": "wait", "args": {}}] * 9}, ACTION_VERSION, ACTION_TYPE),  # at most 8
    ({"hold": False}, "1", ACTION_TYPE),       # an older version
    ({"hold": False}, ACTION_VERSION, "someone.else"),    # not ours: ignored
])
def test_malformed_or_foreign_intent_holds_nothing(payload, version, action_type):
    assert intent_of(_envelope(payload, version, action_type)) == NO_HOLD


@pytest.mark.parametrize("flag,message", [
    ("is_hybrid_swa", "full-attention"), ("enable_hierarchical_cache", "hierarchical"),
    ("disable_radix_cache", "needs the radix cache"),
])
def test_factory_refuses_what_it_cannot_serve(flag, message):
    from radix_ext.sglang.cache import build

    ctx = SimpleNamespace(is_hybrid_swa=False, is_hybrid_ssm=False, is_dsa=False, enable_hierarchical_cache=False,
                          disable_radix_cache=False, tp_size=1, server_args=SimpleNamespace(dp_size=1))
    setattr(ctx, flag, True)
    with pytest.raises(ValueError, match=message):
        build(ctx)


def test_factory_refuses_data_parallel_ranks():
    from radix_ext.sglang.cache import build

    ctx = SimpleNamespace(is_hybrid_swa=False, is_hybrid_ssm=False, is_dsa=False, enable_hierarchical_cache=False,
                          disable_radix_cache=False, tp_size=2, server_args=SimpleNamespace(dp_size=2))
    with pytest.raises(ValueError, match="--dp-size > 1"):
        build(ctx)


def test_factory_refuses_a_kv_layout_it_cannot_copy_at_start():
    """Not at the first turn that forks inside a page (where an MLA pool used to
    leak the page it had taken): at start, naming the pool."""
    from radix_ext.sglang.cache import build

    pool = SimpleNamespace()  # a pool class the tree does not know
    params = SimpleNamespace(token_to_kv_pool_allocator=SimpleNamespace(get_kvcache=lambda: pool))
    ctx = SimpleNamespace(is_hybrid_swa=False, is_hybrid_ssm=False, is_dsa=False, enable_hierarchical_cache=False,
                          disable_radix_cache=False, tp_size=1, server_args=SimpleNamespace(dp_size=1),
                          params=params)
    with pytest.raises(ValueError, match="cannot serve this model's KV cache: the SimpleNamespace KV pool"):
        build(ctx)


def test_reports_ride_a_request_level_key():
    req = SimpleNamespace(output_ids=[], customized_info={"other": [1]})
    attach(req, {"x": 1})
    attach(req, {"x": 2})  # the release's fuller report replaces the intake's, if not sent yet
    assert req.customized_info == {"other": [1], REPORT_KEY: [{"x": 2}]}
    # meta_info as the tokenizer manager accumulates it: the last report counts
    assert report_of({REPORT_KEY: [{"x": 1}, {"x": 2}]}) == {"x": 2} and report_of({}) is None
    with pytest.raises(ControlError, match="ProtocolError"):
        result_of({"v": 99})


# ----- the scheduler-side cache over real pools -----------------------------------


class InProcessCommands:
    """Sends each command as SGLang delivers a command request to the tree:
    intake (the hook before process_input_requests) on the scheduler's thread,
    the request queued, then finish_commands (the hook after it), which takes
    it out of the queue and streams it, answered, unrun; the answer is read
    back as the runtime does."""

    def __init__(self, cache, scheduler, lock):
        from sglang.srt.managers.kv_hints import decode_kv_hints_envelope

        self.cache, self.scheduler, self.lock, self._decode = cache, scheduler, lock, decode_kv_hints_envelope
        self._ids = itertools.count()
        self.served = 0

    def call(self, name, **args):
        rid = f"cmd-{next(self._ids)}"
        hints = self._decode(command_envelope(rid, name, args))
        req = SimpleNamespace(rid=rid, kv_hints=hints, session_id=None, input_ids=[0], output_ids=[],
                              customized_info=None, last_node=None, finished_reason=None)
        streamed = []
        with self.lock:
            self.scheduler.output_streamer = SimpleNamespace(stream_output=lambda reqs, lp: streamed.extend(reqs))
            self.cache.intake(self.scheduler, [req])
            self.scheduler.waiting_queue.append(req)  # what process_input_requests does with it
            self.cache.finish_commands(self.scheduler)
            self.served += 1
        assert streamed == [req] and req not in self.scheduler.waiting_queue and req.finished_reason is not None
        return result_of(report_of({REPORT_KEY: req.customized_info[REPORT_KEY]}))


@pytest.fixture
def served_cache():
    """A SchedulerSessionCache with its commands sent the way requests bring them
    (the lock stands for the scheduler's thread, the only one touching the tree)."""
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams

    from radix_ext.sglang.cache import SchedulerSessionCache

    pools = build_pools(PoolSpec(pool_tokens=64, page_size=PAGE, max_running=4, max_context=64, num_layers=1,
                                 num_kv_heads=1, head_dim=4, dtype=torch.float32, device="cpu"))
    cache = SchedulerSessionCache(CacheInitParams(disable=False, req_to_token_pool=pools.req_to_token,
                                                  token_to_kv_pool_allocator=pools.allocator, page_size=PAGE))
    scheduler = SimpleNamespace(waiting_queue=[], running_batch=None, last_batch=None, idle_sleeper=None)
    lock = threading.Lock()
    yield cache, InProcessCommands(cache, scheduler, lock), pools, lock


def _finish(cache, pools, lock, owner, tokens, intent=ChainIntent(), aborted=False):
    """What the scheduler does for a finished request: insert, lock, release."""
    from radix_ext.tree import Namespace

    with lock:
        key = Namespace().key(tokens)
        slots = pools.allocator.alloc(len(tokens))
        node, prefix = cache.insert_sequence(key, slots)
        if prefix:
            pools.allocator.free(slots[:prefix])
        lock_ref = cache.lock(node)
        cache.unlock(lock_ref)
        reason = SimpleNamespace() if not aborted else type("FINISH_ABORT", (), {})()
        req = SimpleNamespace(session_id=owner, last_node=node, kv_hints=_decoded(intent), finished_reason=reason)
        cache.on_release(req, checkpointed=True)
        return node


def _decoded(intent):
    from sglang.srt.mem_cache.radix_cache import RadixCache  # noqa: F401  (imports sglang's envelope type)
    from sglang.srt.managers.kv_hints import decode_kv_hints_envelope

    return decode_kv_hints_envelope(intent.envelope("m"))


def test_finished_request_moves_the_chain_and_control_reads_it(served_cache):
    cache, client, pools, lock = served_cache
    assert client.call("ping")["backend"] == "session"
    _finish(cache, pools, lock, "a", list(range(1, 13)))
    _finish(cache, pools, lock, "b", list(range(1, 9)) + [50, 51, 52, 53])
    got = client.call("pools")
    assert got["chains"] == {"a": 12, "b": 12} and got["protected"] == 16 and got["evictable"] == 0
    nodes = client.call("snapshot")["nodes"]
    assert sorted((n["tokens"], tuple(n["owners"])) for n in nodes) == [(4, ("a",)), (4, ("b",)), (8, ("a", "b"))]
    assert client.call("snapshot", owner="b")["nodes"][-1]["preview"] == [50, 51, 52, 53]
    assert client.call("probe", tokens=list(range(1, 11))) == {"logical_len": 10, "device_len": 8}
    assert client.call("probe_many", prompts=[list(range(1, 11)), [1, 2, 3, 4, 60]]) == [
        {"logical_len": 10, "device_len": 8}, {"logical_len": 4, "device_len": 4}]
    checked = client.call("check")
    assert (checked["checked"], checked["chains"], checked["ranks"]) == ("full", 2, 1)
    # The turn closes: the chain moves back to the fork point (its partial page
    # copied into a private one), the branch is unheld.
    assert client.call("hold_prefix", owner="a", tokens=list(range(1, 11))) == {"tokens": 10}
    got = client.call("pools")
    assert got["evictable"] == 4 and got["private"] == 4
    assert client.call("release", owner="b") == {"released": True}
    assert client.call("release", owner="b") == {"released": False}
    assert client.call("pools")["chains"] == {"a": 10}
    client.call("check")
    # A dropping policy frees the branch past the fork at once.
    _finish(cache, pools, lock, "c", list(range(1, 13)) + [70, 71, 72, 73])
    assert client.call("hold_prefix", owner="c", tokens=list(range(1, 11)), free_branch=True) == {"tokens": 10}
    got = client.call("pools")
    assert got["evictable"] == 4 and got["private"] == 8  # [9..12] still cached (a's old branch, LRU)
    client.call("check")


def test_intent_hold_false_and_aborted_requests(served_cache):
    cache, client, pools, lock = served_cache
    _finish(cache, pools, lock, "a", list(range(1, 9)))
    _finish(cache, pools, lock, "a", list(range(1, 13)), aborted=True)  # an aborted request moves nothing
    assert client.call("pools")["chains"] == {"a": 8}
    _finish(cache, pools, lock, "a", list(range(1, 13)), intent=ChainIntent(hold=False))
    assert client.call("pools")["chains"] == {}
    client.call("check")


@pytest.mark.parametrize("name,args,error", [
    ("nope", {}, BadCommand), ("release", {"owner": ""}, BadCommand), ("release", {"owner": 3}, BadCommand),
    ("hold_prefix", {"owner": "a", "tokens": [1, -2]}, BadCommand),
    ("hold_prefix", {"owner": "a", "tokens": "1,2"}, BadCommand),
    ("probe", {"tokens": [1], "extra_key": 5}, BadCommand),
    ("snapshot", {"preview_tokens": 10_000}, BadCommand),
    ("probe_many", {"prompts": [[1, 2], [3, "x"]]}, BadCommand),
    ("release", {"owner": "a", "expect_tokens": 4}, StaleCommand),
    ("hold_prefix", {"owner": "a", "tokens": [1, 2, 3, 4], "expect_tokens": 12}, StaleCommand),
])
def test_malformed_or_stale_commands_change_nothing(served_cache, name, args, error):
    cache, client, pools, lock = served_cache
    _finish(cache, pools, lock, "a", list(range(1, 9)))
    before = (client.call("pools"), client.call("snapshot"))
    with pytest.raises(error):
        client.call(name, **args)
    after = (client.call("pools"), client.call("snapshot"))
    strip = lambda snap: [{k: v for k, v in n.items() if k != "last_access_age_s"} for n in snap["nodes"]]  # noqa: E731
    assert before[0] == after[0] and strip(before[1]) == strip(after[1])
    client.call("check")


def test_integrity_failure_is_reported_not_raised_into_the_scheduler(served_cache):
    cache, client, pools, lock = served_cache
    node = _finish(cache, pools, lock, "a", list(range(1, 9)))
    with lock:
        node.lock_ref += 1  # a stray lock
    with pytest.raises(ControlError, match="stray locks"):
        client.call("check")
    with lock:
        node.lock_ref -= 1
    client.call("check")


def test_many_threads_call_the_channel_at_once(served_cache):
    cache, client, pools, lock = served_cache
    _finish(cache, pools, lock, "a", list(range(1, 9)))
    errors = []

    def worker(i):
        try:
            for _ in range(20):
                assert client.call("pools")["chains"] == {"a": 8}
                assert client.call("probe", tokens=list(range(1, 6)))["device_len"] == 4
        except Exception as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and client.served >= 16 * 40 and len(cache.reports) == 0


def test_a_server_that_cannot_be_reached_is_channel_down():
    import socket

    from session_runtime.backends.sglang.control_client import RequestControl, client

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(ChannelDown, match="cannot be reached"):
        RequestControl(f"http://127.0.0.1:{port}", client(), timeout_s=2).call("ping")


def test_idle_chains_retire_after_their_ttl_and_under_pressure(served_cache):
    """Idle chains leave the device after the TTL, or oldest first while the
    head of the waiting queue cannot fit and nothing runs."""
    cache, client, pools, lock = served_cache
    for owner, base in (("old", 100), ("new", 200), ("busy", 300)):
        _finish(cache, pools, lock, owner, list(range(base, base + 16)))
    assert client.call("idle", owner="old", ttl_s=0) == {"idle": True}
    assert client.call("idle", owner="new", ttl_s=0) == {"idle": True}
    assert client.call("idle", owner="nobody", ttl_s=0) == {"idle": False}
    with pytest.raises(BadCommand):
        client.call("idle", owner="old", ttl_s=-1)
    with lock:
        free = pools.allocator.available_size()
        head = SimpleNamespace(origin_input_ids=[1] * (free + 4 - PAGE), sampling_params=SimpleNamespace(max_new_tokens=0))
        running = SimpleNamespace(reqs=[SimpleNamespace()])
        cache.relieve(SimpleNamespace(waiting_queue=[head], running_batch=running))
        assert set(cache.chains) == {"old", "new", "busy"}  # a running request will free pages
        cache.relieve(SimpleNamespace(waiting_queue=[head], running_batch=None))
        assert set(cache.chains) == {"new", "busy"}  # the oldest idle chain goes, and that is enough
        assert cache.idle.stats["pressure_released"] == 1
        cache.idle.mark("busy", ttl_s=5.0, now=0.0)
        assert cache.idle.retire_due(cache, now=4.0) == 0
        assert cache.idle.retire_due(cache, now=6.0) == 1 and set(cache.chains) == {"new"}
    client.call("check")


def test_held_chains_nothing_uses_make_room_before_a_request_waits_or_is_retracted(served_cache):
    """Chains neither idle nor registered as tool waits (a tool wait under offload
    `never`) are relieved too, least recently used first, but never one whose
    conversation has a request in the scheduler; SGLang's allocator asks the
    tree (`evict_for_alloc`, its path to retraction) and gets the room."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    cache, client, pools, lock = served_cache
    for owner, base in (("waits-1", 100), ("queued", 200), ("waits-2", 300)):
        _finish(cache, pools, lock, owner, list(range(base, base + 14)))  # 3 pages and a private page each
    with lock:
        cache._scheduler = SimpleNamespace(waiting_queue=[SimpleNamespace(session_id="queued")], running_batch=None)
        evictable, free = cache.evictable_size(), pools.allocator.available_size()
        cache.evict_for_alloc(EvictParams(num_tokens=evictable + 10))  # one chain's pages are enough
        assert set(cache.chains) == {"queued", "waits-2"}  # the least recently used went
        assert pools.allocator.available_size() >= free + 10
        evictable, free = cache.evictable_size(), pools.allocator.available_size()
        cache.evict_for_alloc(EvictParams(num_tokens=evictable + 30))  # more than any chain nothing uses
        assert set(cache.chains) == {"queued"}  # a conversation with a request queued keeps its chain
        assert cache.idle.stats["pressure_released"] == 2
    client.call("check")


def test_tool_wait_demote_and_promote_in_the_scheduler_are_bit_identical(served_cache):
    cache, client, pools, lock = served_cache
    tokens = list(range(500, 514))  # 3 whole pages and 2 private tokens at page 4
    _finish(cache, pools, lock, "shared", tokens[:4])
    _finish(cache, pools, lock, "t", tokens[:12])
    with lock:  # the finished request's private partial page, as the scheduler keeps it
        page = pools.allocator.alloc(PAGE)
        cache.set_chain("t", cache.chains["t"], cache.make_tail(tokens[12:], page))
        slots = cache.chain_slots("t")
        for k in pools.kv.k_buffer:
            k[slots] = torch.randn(k[slots].shape)
        before = [k[slots].clone() for k in pools.kv.k_buffer]
        free = pools.allocator.available_size()
    assert client.call("demote", owner="t", host_tokens=64) == {"tokens": 10}  # all but the shared page
    assert client.call("host", owner="t")["bytes"] > 0 and client.call("pools")["chains"]["t"] == 4
    assert pools.allocator.available_size() == free + 3 * PAGE
    client.call("check")
    with pytest.raises(BadCommand):
        client.call("demote", owner="t", host_tokens=-1)
    got = client.call("promote", owner="t", tokens=tokens + [9, 9])
    assert got == {"anchor": 4, "tokens": 10, "shared": False, "on_host": False}
    with lock:
        assert cache.chain_tokens("t") == 14 and cache.tails["t"].tokens.tolist() == tokens[12:]
        slots = cache.chain_slots("t")
        assert all(torch.equal(k[slots], b) for k, b in zip(pools.kv.k_buffer, before))
    nothing = {"anchor": 0, "tokens": 0, "shared": False, "on_host": False}
    assert client.call("promote", owner="t", tokens=tokens) == nothing  # nothing left on the host
    client.call("check")


def test_a_host_copy_is_shared_with_a_prompt_that_continues_it(served_cache):
    """Another owner's prompt that shares t's host copy at least a page beyond
    the device tree promotes it back under t's chain (bit-identical), counts
    only the shared span, and t waits again; another namespace, or a prompt
    that shares less than a page more, gets nothing."""
    cache, client, pools, lock = served_cache
    tokens = list(range(500, 514))
    _finish(cache, pools, lock, "shared", tokens[:4])
    _finish(cache, pools, lock, "t", tokens[:12])
    with lock:
        slots = cache.chain_slots("t")
        for k in pools.kv.k_buffer:
            k[slots] = torch.randn(k[slots].shape)
        before = [k[slots].clone() for k in pools.kv.k_buffer]
    assert client.call("demote", owner="t", host_tokens=64) == {"tokens": 8}
    none = {"anchor": 0, "tokens": 0, "shared": True, "on_host": False}
    assert client.call("promote", owner="u", tokens=tokens[:12] + [7] * 5, share=True, extra_key="x") == none
    assert client.call("promote", owner="u", tokens=tokens[:7] + [7] * 5, share=True) == none  # 3 tokens beyond the page
    assert client.call("host", owner="t")["bytes"] > 0  # neither moved it
    got = client.call("promote", owner="u", tokens=tokens[:10] + [7] * 5, share=True)
    assert got == {"anchor": 4, "tokens": 4, "shared": True, "on_host": False}  # 10 shared, 8 page-aligned
    with lock:
        assert cache.chain_tokens("t") == 12 and "t" in cache.offload.waiting
        assert cache.offload.host.stats.shared_tokens == 4
        slots = cache.chain_slots("t")
        assert all(torch.equal(k[slots], b) for k, b in zip(pools.kv.k_buffer, before))
    with pytest.raises(BadCommand):
        client.call("promote", owner="u", tokens=tokens, share="yes")
    client.call("check")


def test_a_steps_probes_are_read_at_intake_and_reported_at_its_release(served_cache):
    """The counterfactual probes and the logical probe ride the step's hints:
    intake reads the tree before the step runs; the report (with the chain
    after it) comes back on the step's own release."""
    from sglang.srt.managers.kv_hints import decode_kv_hints_envelope

    cache, client, pools, lock = served_cache
    _finish(cache, pools, lock, "a", list(range(1, 13)))
    prompt = list(range(1, 11)) + [99]
    intent = ChainIntent(probes=((10, (5, 6)), (4, ())))  # [1..10, 5, 6] and [1..4]
    req = SimpleNamespace(rid="step-1", kv_hints=decode_kv_hints_envelope(intent.envelope("step-1")), session_id="a",
                          input_ids=prompt, extra_key=None, cache_salt=None)
    with lock:
        cache.intake(None, [req])
    _finish(cache, pools, lock, "a", list(range(1, 13)) + [7, 7, 7, 7])  # the tree changes after intake
    report = cache.reports.pop("step-1")
    assert report["probes"] == [[10, 8], [3, 0]] and report["logical_len"] == 10
    assert report["promoted"] == {"anchor": 0, "tokens": 0}


def test_a_chain_whose_runtime_stops_renewing_its_lease_returns_to_the_lru(served_cache):
    cache, client, pools, lock = served_cache
    held = ChainIntent(holder="runtime-1", lease_s=60.0)
    _finish(cache, pools, lock, "a", list(range(1, 9)), intent=held)
    _finish(cache, pools, lock, "b", list(range(20, 28)), intent=held)
    _finish(cache, pools, lock, "free", list(range(40, 48)))  # no lease: only a release frees it
    assert client.call("pools")["leases"] == {"holders": 1, "chains": 2, "expired_chains": 0}
    assert client.call("renew", holder="runtime-1", lease_s=60) == {"chains": 2}
    with pytest.raises(BadCommand):
        client.call("renew", holder="", lease_s=60)
    with lock:
        assert cache.leases.expired() == []
        cache.leases.until["runtime-1"] = 0.0  # the heartbeat stopped long ago
        cache.relieve(None)
        assert set(cache.chains) == {"free"} and cache.protected_size() == 8
    # A restarted runtime keeps what it knows and releases the rest, but not
    # what another live runtime holds.
    _finish(cache, pools, lock, "a", list(range(1, 9)), intent=held)
    _finish(cache, pools, lock, "other", list(range(60, 68)), intent=ChainIntent(holder="runtime-3", lease_s=60.0))
    assert client.call("adopt", holder="runtime-2", lease_s=30, keep=["a", "gone"]) == {"released": 1, "adopted": 1}
    assert set(cache.chains) == {"a", "other"}
    assert cache.leases.holder_of == {"a": "runtime-2", "other": "runtime-3"}
    client.call("check")


def test_a_host_copy_whose_chain_is_gone_is_dropped_not_promoted(served_cache):
    """A host copy whose chain was released meanwhile (pressure, a lease) is
    stale: promoting it allocates nothing and leaks nothing."""
    cache, client, pools, lock = served_cache
    tokens = list(range(700, 712))
    _finish(cache, pools, lock, "t", tokens)
    assert client.call("demote", owner="t", host_tokens=64)["tokens"] > 0
    with lock:
        cache.release_chain("t")  # what an older idle retirement did, leaving the host copy behind
        free = pools.allocator.available_size()
    nothing = {"anchor": 0, "tokens": 0, "shared": False, "on_host": False}
    assert client.call("promote", owner="t", tokens=tokens + [1]) == nothing
    assert pools.allocator.available_size() == free
    client.call("check")


def test_a_close_that_rides_a_step_runs_at_its_intake_first(served_cache):
    """The previous step's close rides the conversation's next step: its intake
    runs it before the step's probes, so the step sees the chain at the fork;
    one for another conversation is refused and changes nothing."""
    from sglang.srt.managers.kv_hints import decode_kv_hints_envelope

    cache, client, pools, lock = served_cache
    _finish(cache, pools, lock, "a", list(range(1, 13)) + [70, 71, 72, 73])
    _finish(cache, pools, lock, "b", list(range(1, 9)) + [50, 51, 52, 53])
    close = ("close", {"owner": "a", "tokens": list(range(1, 11)), "free_branch": True, "ttl_s": 0})
    foreign = ("close", {"owner": "b", "tokens": [1, 2, 3, 4]})
    intent = ChainIntent(before=(close, foreign), probes=((10, ()),))
    req = SimpleNamespace(rid="step-1", kv_hints=decode_kv_hints_envelope(intent.envelope("m")), session_id="a",
                          input_ids=list(range(1, 11)) + [90, 91], extra_key=None, cache_salt=None)
    with lock:
        cache.intake(SimpleNamespace(waiting_queue=[]), [req])
        report = cache.reports.pop("step-1")
    closed, refused = report["before"]
    assert closed["ok"] and closed["result"]["tokens"] == 10
    assert not refused["ok"] and "for that conversation only" in refused["error"]["message"]
    assert client.call("pools")["chains"] == {"a": 10, "b": 12}  # b's chain untouched
    # Probed after the close: the branch past the fork is gone from the tree (before it, 9 tokens
    # matched), the fork's partial page is the chain's private page: the tree shares whole pages.
    assert report["probes"] == [[8, 8]]
    client.call("check")


def test_a_batch_runs_each_close_or_wait_in_order_and_refuses_other_commands(served_cache):
    """What waited to ride in vain leaves as one `batch` command: each of its
    commands runs and answers on its own; only close and wait may be in it."""
    cache, client, pools, lock = served_cache
    _finish(cache, pools, lock, "a", list(range(1, 13)) + [70, 71, 72, 73])
    _finish(cache, pools, lock, "b", list(range(1, 9)) + [50, 51, 52, 53])
    got = client.call("batch", commands=[
        {"cmd": "close", "args": {"owner": "a", "tokens": list(range(1, 11)), "free_branch": True}},
        {"cmd": "release", "args": {"owner": "b"}},
        {"cmd": "wait", "args": {"owner": "b", "host_tokens": 0}},
    ])
    assert [g["ok"] for g in got] == [True, False, True]
    assert "only" in got[1]["error"]["message"]
    assert client.call("pools")["chains"] == {"a": 10, "b": 12}  # b still held: the release was refused
    client.call("check")



def test_idle_chains_are_kept_oldest_first_and_retire_due_reads_only_the_due():
    """retire_due runs every scheduler iteration: it reads the due prefix of the
    idle chains (kept in the order they went idle; a mark moves one to the end)
    instead of sorting them all each time."""
    from types import SimpleNamespace

    from radix_ext.sglang.idle import IdleChains

    idle = IdleChains()
    for k in range(1000):
        idle.mark(f"c{k}", ttl_s=10.0, now=float(k))
    idle.mark("c0", ttl_s=10.0, now=1000.0)  # active again, idle again: now the newest
    idle.mark("early", ttl_s=10.0, now=-1.0)  # a caller's own clock, out of order: still sorted
    assert list(idle.since)[:3] == ["early", "c1", "c2"] and list(idle.since)[-1] == "c0"
    nothing_held = SimpleNamespace(chains={})
    assert idle.retire_due(nothing_held, now=15.0) == 6  # early, c1..c5: since <= 5
    assert list(idle.since)[0] == "c6"
    assert idle.retire_due(nothing_held, now=15.0) == 0
