"""Counters for /metrics, in Prometheus text format."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from session_runtime.accounting import StepAccounting

_COUNTERS = {
    "steps_total": "Steps run",
    "prompt_tokens_total": "Prompt tokens over all steps",
    "cached_input_tokens_total": "Prompt tokens whose device KV was reused",
    "prefill_tokens_total": "Prompt tokens computed by prefill",
    "recomputed_history_tokens_total": "Prefill spent on history tokens",
    "output_tokens_total": "Tokens generated or forced",
    "step_errors_total": "Steps that failed with a client or pool error",
}


@dataclass
class Metrics:
    counters: dict[str, float] = field(default_factory=lambda: dict.fromkeys(_COUNTERS, 0))
    latency_ms_sum: float = 0.0
    ttft_ms_sum: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def record_step(self, acc: StepAccounting, total_ms: float) -> None:
        with self._lock:
            c = self.counters
            c["steps_total"] += 1
            c["prompt_tokens_total"] += acc.prompt_tokens
            c["cached_input_tokens_total"] += acc.cached_input_tokens
            c["prefill_tokens_total"] += acc.uncached_prefill_tokens
            c["recomputed_history_tokens_total"] += acc.recomputed_history_tokens
            c["output_tokens_total"] += acc.output_tokens
            self.latency_ms_sum += total_ms
            self.ttft_ms_sum += acc.ttft_ms

    def record_error(self) -> None:
        with self._lock:
            self.counters["step_errors_total"] += 1

    def render(self, gauges: dict[str, float]) -> str:
        """Prometheus exposition text: counters, latency sums and the given gauges."""
        lines = []
        with self._lock:
            for name, help_text in _COUNTERS.items():
                lines += [f"# HELP session_{name} {help_text}", f"# TYPE session_{name} counter",
                          f"session_{name} {self.counters[name]:g}"]
            for name, value in (("step_latency_ms_sum", self.latency_ms_sum), ("ttft_ms_sum", self.ttft_ms_sum)):
                lines += [f"# TYPE session_{name} counter", f"session_{name} {value:.3f}"]
        for name, value in gauges.items():
            lines += [f"# TYPE session_{name} gauge", f"session_{name} {value:g}"]
        return "\n".join(lines) + "\n"
