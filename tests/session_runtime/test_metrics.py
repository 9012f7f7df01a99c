"""/metrics by Prometheus' conventions, read back with Prometheus' own parser:
counters and cumulative histograms in seconds, every family prefixed with a HELP
and a TYPE line; the embedded engine's offload totals as counters in bytes,
tokens and seconds; the SGLang backends' samples (one worker, and labelled per
worker) without a server."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest

from radix_ext.host_tier import TransferStats
from session_runtime import Runtime, RuntimeConfig
from session_runtime.accounting import StepAccounting
from session_runtime.backends.sglang.backend import SGLangBackend
from session_runtime.backends.sglang.workers import WorkerPool
from session_runtime.errors import BackendUnavailable
from session_runtime.metrics import Metrics, counter, gauge
from tests.prometheus import parse


def acc(ttft_ms: float) -> StepAccounting:
    return StepAccounting(
        prompt_tokens=10, cached_input_tokens=4, host_loaded_tokens=0, uncached_prefill_tokens=6,
        logical_reusable_tokens=4, alignment_loss_tokens=0, recomputed_history_tokens=1,
        active_context_length=12, output_tokens=2, kv_device_bytes=0, kv_host_bytes=0,
        prefill_ms=1.0, ttft_ms=ttft_ms, tpot_ms=1.0, attention_work=45,
        uncached=[{"reason": "new_input", "tokens": 5}, {"reason": "evicted", "tokens": 1}],
    )


def test_histograms_are_in_seconds_and_cumulative_and_counters_add_up():
    m = Metrics()
    for total_ms, ttft_ms in ((3.0, 2.0), (40.0, 30.0), (70000.0, 20.0)):
        m.record_step(acc(ttft_ms), total_ms)
    m.record_error()
    text = m.render([gauge("pool_free_tokens", 7, "Free KV slots")])
    s = parse(text)
    assert s['session_runtime_step_latency_seconds_bucket{le="0.005"}'] == 1
    assert s['session_runtime_step_latency_seconds_bucket{le="0.05"}'] == 2
    assert s['session_runtime_step_latency_seconds_bucket{le="30.0"}'] == 2
    assert s['session_runtime_step_latency_seconds_bucket{le="+Inf"}'] == 3
    assert s["session_runtime_step_latency_seconds_count"] == 3
    assert s["session_runtime_step_latency_seconds_sum"] == pytest.approx(70.043)
    assert s['session_runtime_time_to_first_token_seconds_bucket{le="0.025"}'] == 2
    assert s["session_runtime_time_to_first_token_seconds_sum"] == pytest.approx(0.052)
    assert s["session_runtime_steps_total"] == 3
    assert s["session_runtime_prefill_tokens_total"] == 18
    assert s["session_runtime_cached_input_tokens_total"] == 12
    assert s["session_runtime_step_errors_total"] == 1
    # Uncached tokens by reason: every reason a series, the reasons summing to the prefill.
    from session_runtime.uncached import REASONS
    by_reason = {r: s[f'session_runtime_uncached_tokens_total{{reason="{r}"}}'] for r in REASONS}
    assert by_reason == {**dict.fromkeys(REASONS, 0), "new_input": 15, "evicted": 3}
    assert sum(by_reason.values()) == s["session_runtime_prefill_tokens_total"]
    assert s["session_runtime_pool_free_tokens"] == 7
    assert "# TYPE session_runtime_pool_free_tokens gauge\n" in text
    assert "# HELP session_runtime_pool_free_tokens Free KV slots\n" in text
    assert "# TYPE session_runtime_steps_total counter\n" in text
    assert "# TYPE session_runtime_step_latency_seconds histogram\n" in text


def test_series_of_a_family_are_grouped_labelled_and_escaped():
    samples = [
        gauge("pool_free_tokens", 7, "Free KV slots").labelled(worker="w0"),
        counter("moved_total", 2, 'Moved\nback "slash" \\'),
        gauge("pool_free_tokens", 12345678, "Free KV slots").labelled(worker='w"1'),
    ]
    text = Metrics().render(samples)
    s = parse(text)
    assert s['session_runtime_pool_free_tokens{worker="w0"}'] == 7
    assert s['session_runtime_pool_free_tokens{worker="w"1"}'] == 12345678  # the parser unescapes
    # prometheus_client writes large values in exponent form, every digit kept (never 1.23457e+07).
    assert 'session_runtime_pool_free_tokens{worker="w\\"1"} 1.2345678e+07\n' in text
    assert "# HELP session_runtime_moved_total Moved\\nback \"slash\" \\\\\n" in text
    assert text.count("# TYPE session_runtime_pool_free_tokens gauge\n") == 1


def test_a_sample_name_says_its_type():
    with pytest.raises(AssertionError, match="end in _total"):
        gauge("materialized_total", 1, "a total typed gauge")
    with pytest.raises(AssertionError, match="end in _total"):
        counter("materialized", 1, "a counter without _total")
    with pytest.raises(AssertionError, match="mixed kind or help"):
        Metrics().render([gauge("x", 1, "one"), gauge("x", 2, "another")])


# ----- the embedded engine --------------------------------------------------


def words(n: int) -> str:
    return " alpha" * n


def test_offload_totals_are_counters_in_tokens_bytes_and_seconds():
    rt = Runtime(RuntimeConfig(model="tiny", page_size=16, pool_tokens=4096, host_pool_tokens=2048,
                               max_context=2048), background=False)
    try:
        cid = rt.create_conversation(system=words(40), tenant="metrics", policy="drop", offload="always")
        step = rt.send_message(cid, words(5), forced={"reasoning": words(60),
                                                      "tool_calls": [{"name": "f", "arguments": {"x": 1}}]})
        moved = rt.offload.run_due()
        assert moved == 153  # the tool step's whole chain (test_offload.py: CHAIN)
        rt.send_tool_results(cid, [{"tool_call_id": step.tool_calls[0]["id"], "content": "ok"}],
                             forced={"reasoning": words(3), "content": words(4)})
        text = Metrics().render(rt.metric_samples())
        s = parse(text)  # the step counters and histograms are in every /metrics text
        stats = rt.engine.host.stats
        per_token = rt.engine.bytes_per_token
        assert s["session_runtime_offload_demoted_tokens_total"] == 153
        assert s["session_runtime_offload_promoted_tokens_total"] == 153
        assert s["session_runtime_offload_demoted_bytes_total"] == 153 * per_token
        assert s["session_runtime_offload_promoted_bytes_total"] == 153 * per_token
        assert s["session_runtime_offload_demote_seconds_total"] == pytest.approx(stats.demote_ms / 1e3)
        assert s["session_runtime_offload_promote_seconds_total"] == pytest.approx(stats.promote_ms / 1e3)
        assert s["session_runtime_offload_lost_tokens_total"] == 0
        assert s["session_runtime_offload_shared_tokens_total"] == 0
        # Every transfer figure the host tier keeps is exported.
        assert len(dataclasses.fields(TransferStats)) == 8
        for name in ("demoted_tokens", "demoted_bytes", "demote_seconds", "promoted_tokens", "promoted_bytes",
                     "promote_seconds", "lost_tokens", "shared_tokens"):
            assert f"# TYPE session_runtime_offload_{name}_total counter\n" in text
        for name in ("materialized_total", "materialize_cancelled_total", "materialize_joined_total"):
            assert f"# TYPE session_runtime_{name} counter\n" in text
        for name in ("pool_capacity_tokens", "pool_free_tokens", "tree_locked_tokens", "tree_evictable_tokens",
                     "tree_private_tokens", "host_capacity_tokens", "host_used_tokens", "backend_up",
                     "conversations"):
            assert f"# TYPE session_runtime_{name} gauge\n" in text
        assert (s["session_runtime_pool_capacity_tokens"], s["session_runtime_host_capacity_tokens"]) == (4096, 2048)
        assert (s["session_runtime_backend_up"], s["session_runtime_conversations"]) == (1, 1)
        assert_dashboard_names_exported(s)
    finally:
        rt.close()


DASHBOARD = Path(__file__).resolve().parents[2] / "examples" / "grafana" / "dashboard.json"


def assert_dashboard_names_exported(series: dict[str, float]) -> None:
    """Every query of the shipped Grafana dashboard names only series that
    /metrics exports (here: the embedded engine's, which has every family the
    dashboard draws), and the dashboard is Grafana 10+ JSON with a Prometheus
    data source variable."""
    dash = json.loads(DASHBOARD.read_text())
    assert dash["schemaVersion"] >= 38 and dash["templating"]["list"][0]["type"] == "datasource"
    exported = {key.split("{")[0] for key in series}
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    assert len(exprs) >= 10
    for expr in exprs:
        names = re.findall(r"\bsession_runtime_[a-z_]+", expr)
        assert names, expr
        assert set(names) <= exported, f"{expr}: {set(names) - exported} not exported"
    drawn = {n for e in exprs for n in re.findall(r"\bsession_runtime_[a-z_]+", e)}
    for needed in ("session_runtime_uncached_tokens_total", "session_runtime_time_to_first_token_seconds_bucket",
                   "session_runtime_step_latency_seconds_bucket", "session_runtime_pool_free_tokens",
                   "session_runtime_host_used_tokens", "session_runtime_materialized_total",
                   "session_runtime_offload_demoted_tokens_total"):
        assert needed in drawn, needed


# ----- the SGLang backends, without a server -----------------------------------

POOLS = {"capacity": 2048, "available": 1000, "protected": 48, "evictable": 96, "running": 2}


def fake_worker(pools: dict) -> SGLangBackend:
    """An SGLangBackend whose control channel answers `pools` (or is down: None)."""
    w = SGLangBackend.__new__(SGLangBackend)
    w.page_size, w.bytes_per_token, w.capacity, w.vocab_size, w.max_context = 16, 8, 2048, 1000, 4096
    w.url = "http://127.0.0.1:9"

    def answer() -> dict:
        if pools is None:
            raise BackendUnavailable("the SGLang server is gone")
        return pools

    w.pools = answer
    w.close = lambda: None
    return w


def test_one_sglang_worker_reports_its_pool_as_gauges():
    own = parse(Metrics().render([]))  # the step counters and histograms
    s = parse(Metrics().render(fake_worker(POOLS).metric_samples()))
    assert {k: v for k, v in s.items() if k not in own} == {
        "session_runtime_pool_capacity_tokens": 2048, "session_runtime_pool_free_tokens": 1000,
        "session_runtime_tree_locked_tokens": 48, "session_runtime_tree_evictable_tokens": 96,
        "session_runtime_sglang_requests_in_scheduler": 2,
    }


def test_many_sglang_workers_label_each_pool_and_skip_a_dead_one():
    pool = WorkerPool({"w0": fake_worker(POOLS), "w1": fake_worker({**POOLS, "available": 7}),
                       "w2": fake_worker(None)}, health_interval_s=3600)
    try:
        pool.moves = 3
        text = Metrics().render(pool.metric_samples())
        s = parse(text)
        assert s['session_runtime_pool_free_tokens{worker="w0"}'] == 1000
        assert s['session_runtime_pool_free_tokens{worker="w1"}'] == 7
        assert s['session_runtime_sglang_requests_in_scheduler{worker="w1"}'] == 2
        # No unlabelled total beside the workers' series (sum() would count it twice).
        assert "session_runtime_pool_free_tokens" not in s
        assert not any('worker="w2"' in k for k in s)  # it did not answer: marked down
        assert pool.up == {"w0": True, "w1": True, "w2": False}
        assert s["session_runtime_sglang_workers_up"] == 2
        assert s["session_runtime_sglang_workers_draining"] == 0
        assert s["session_runtime_sglang_conversations_moved_total"] == 3
        assert text.count("# HELP session_runtime_pool_free_tokens ") == 1
        assert "# TYPE session_runtime_sglang_conversations_moved_total counter\n" in text
    finally:
        pool.close()



def test_accounting_as_dict_is_asdict_and_shares_nothing():
    """A step's accounting as its response carries it: every field, as
    `dataclasses.asdict` gives it, nested values copied (a caller that changes
    the dict changes nothing of the step)."""
    acc = StepAccounting(1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 1.0, 2.0, 3.0, 12, cache_state="prefix_only",
                         counterfactual={"keep": {"prefill": 5, "pages": [1, 2]}, "drop": {"prefill": 9}},
                         upstream={"usage": {"input": [1, 2]}}, uncached=[{"reason": "new_input", "tokens": 3}])
    out = acc.as_dict()
    assert out == dataclasses.asdict(acc) and list(out) == [f.name for f in dataclasses.fields(acc)]
    out["counterfactual"]["keep"]["pages"].append(3)
    out["uncached"][0]["tokens"] = 0
    out["upstream"]["usage"]["input"].clear()
    assert acc.counterfactual["keep"]["pages"] == [1, 2] and acc.uncached[0]["tokens"] == 3
    assert acc.upstream["usage"]["input"] == [1, 2]


def test_a_strip_account_as_dict_is_asdict_and_its_shares():
    from session_runtime.proxy.outbound import StripAccount

    names = [f.name for f in dataclasses.fields(StripAccount)]
    account = StripAccount("chat", "lenient", True, *range(3, 3 + len(names) - 3))
    out = account.as_dict()
    assert out == {**dataclasses.asdict(account), "reasoning_share": round(account.reasoning_share, 4),
                   "sent_reasoning_share": round(account.sent_reasoning_share, 4)}
    assert list(out)[:len(names)] == names
