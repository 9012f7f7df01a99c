"""Stateless steps through sglang-router, without a server: what a routed
request carries, how a tenant's salt survives the router, and where the pool
sends a stateless owner (the router while it runs, else a worker). The real
router over two real workers is tested in test_sglang_workers.py."""

from __future__ import annotations

import threading
from types import SimpleNamespace

from radix_ext.tree import Namespace, NodeInfo
from session_runtime.backends.base import StepRequest
from session_runtime.backends.sglang.backend import SGLangBackend
from session_runtime.backends.sglang.keeper import ServerKeeper
from session_runtime.backends.sglang.router import RoutedBackend, RouterSpec, routed_namespace, unfold
from session_runtime.backends.sglang.workers import WorkerPool

LIKE = SimpleNamespace(page_size=16, capacity=2048, bytes_per_token=8, vocab_size=1000, max_context=4096,
                       constrains=True)


def _worker(url: str) -> SGLangBackend:
    w = SGLangBackend.__new__(SGLangBackend)
    w.page_size, w.bytes_per_token, w.capacity, w.vocab_size, w.max_context = 16, 8, 2048, 1000, 4096
    w.url, w.keeper = url, ServerKeeper(None, url, lambda: 0, threading.Event())  # given by URL: none to keep
    w.close, w.metric_samples = (lambda: None), (lambda: [])
    return w


def _router(up: bool = True) -> RoutedBackend:
    return RoutedBackend("http://127.0.0.1:9", LIKE, router=SimpleNamespace(alive=lambda: up, stop=lambda: None))


def test_the_tenant_salt_rides_in_extra_key_and_comes_back_in_the_tree_view():
    ns = Namespace(extra_key="m|digest|deepseek", cache_salt="acme")
    routed = routed_namespace(ns)
    assert routed == Namespace(extra_key="m|digest|deepseek|salt=acme", cache_salt=None)
    assert routed_namespace(Namespace(extra_key="m|d|t")) == Namespace(extra_key="m|d|t")  # no tenant: as it is
    node = NodeInfo(id=1, parent=0, tokens=16, depth_tokens=16, preview="", hit_count=0, lock_count=0,
                    last_access_age_s=0.0, residency="device", owners=(), namespace=routed.extra_key)
    assert (unfold(node).namespace, unfold(node).cache_salt) == ("m|digest|deepseek", "acme")
    plain = NodeInfo(**{**node.__dict__, "namespace": "m|d|t", "cache_salt": "acme"})
    assert unfold(plain) is plain


def test_a_routed_request_carries_input_ids_and_only_fields_the_router_passes_on():
    router = _router()
    try:
        req = StepRequest(owner="c1", prompt=[5, 6, 7], namespace=routed_namespace(Namespace("m|d|t", "acme")))
        body = router._body(req, [5, 6, 7], None, False)
        assert body["input_ids"] == [5, 6, 7] and body["stream"] is True
        assert body["extra_key"] == "m|d|t|salt=acme"
        assert not {"session_id", "kv_hints", "cache_salt"} & set(body)
        assert router.probe(req.namespace, [5, 6, 7]).logical_len == 0  # it cannot read a tree it does not pick
        assert router.chain_tokens("c1") == 0 and router.lock_prefix("c1", req.namespace, [5]) == 0
    finally:
        router.close()


def test_the_router_is_launched_with_the_cache_aware_policy_over_every_worker():
    argv = RouterSpec(worker_urls=("http://127.0.0.1:1", "http://127.0.0.1:2")).argv(30000)
    assert argv[1:3] == ["-m", "sglang_router.launch_router"]
    i = argv.index("--worker-urls")
    assert argv[i + 1:i + 3] == ["http://127.0.0.1:1", "http://127.0.0.1:2"]
    assert argv[argv.index("--policy") + 1] == "cache_aware" and argv[argv.index("--port") + 1] == "30000"
    # Its metrics on loopback, on a free port of its own: two runtime processes over the same
    # workers each run a router (sglang-router's default, 29000 on every interface, lets one).
    other = RouterSpec(worker_urls=("http://127.0.0.1:1",)).argv(30001)
    assert argv[argv.index("--prometheus-host") + 1] == "127.0.0.1"
    assert argv[argv.index("--prometheus-port") + 1] != other[other.index("--prometheus-port") + 1]


def test_a_stateless_owner_goes_to_the_router_while_it_runs_and_else_to_a_worker():
    up = {"router": True}
    router = RoutedBackend("http://127.0.0.1:9", LIKE,
                           router=SimpleNamespace(alive=lambda: up["router"], stop=lambda: None))
    pool = WorkerPool({"w0": _worker("http://127.0.0.1:1"), "w1": _worker("http://127.0.0.1:2")},
                      health_interval_s=3600, router=router)
    try:
        assert pool.place("s1", stateless=True) is None and pool.worker_of("s1") is None
        assert pool.route("s1") is router
        assert pool.place("c1") in ("w0", "w1") and pool.route("c1") is not router  # conversations: affinity
        pool.release("s1")  # nothing held anywhere: only forgotten
        assert "s1" not in pool.stateless
        up["router"] = False  # its process is gone: placed like a conversation
        assert pool.place("s2", stateless=True) in ("w0", "w1")
        assert pool.route("s2") is pool.workers[pool.worker_of("s2")]
        assert {s.name: s.value for s in pool.metric_samples() if "router" in s.name} == {
            "sglang_router_up": 0, "sglang_router_steps_total": 0}
    finally:
        pool.close()
