"""Prometheus text: counters and cumulative latency histograms."""

from __future__ import annotations

from session_runtime.accounting import StepAccounting
from session_runtime.metrics import Metrics


def acc(ttft: float) -> StepAccounting:
    return StepAccounting(
        prompt_tokens=10, cached_input_tokens=4, host_loaded_tokens=0, uncached_prefill_tokens=6,
        logical_reusable_tokens=4, alignment_loss_tokens=0, recomputed_history_tokens=1,
        active_context_length=12, output_tokens=2, kv_device_bytes=0, kv_host_bytes=0,
        prefill_ms=1.0, ttft_ms=ttft, tpot_ms=1.0, attention_work=45,
    )


def test_histograms_are_cumulative_and_counters_add_up():
    m = Metrics()
    for total, ttft in ((3.0, 2.0), (40.0, 30.0), (70000.0, 20.0)):
        m.record_step(acc(ttft), total)
    m.record_error()
    lines = dict(line.rsplit(" ", 1) for line in m.render({"pool_free_tokens": 7}).splitlines()
                 if not line.startswith("#"))
    assert lines['session_step_latency_ms_bucket{le="5"}'] == "1"
    assert lines['session_step_latency_ms_bucket{le="50"}'] == "2"
    assert lines['session_step_latency_ms_bucket{le="30000"}'] == "2"
    assert lines['session_step_latency_ms_bucket{le="+Inf"}'] == "3"
    assert lines["session_step_latency_ms_count"] == "3"
    assert float(lines["session_step_latency_ms_sum"]) == 70043.0
    assert lines['session_ttft_ms_bucket{le="25"}'] == "2"
    assert lines["session_prefill_tokens_total"] == "18"
    assert lines["session_cached_input_tokens_total"] == "12"
    assert lines["session_step_errors_total"] == "1"
    assert lines["session_pool_free_tokens"] == "7"
