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


_BUCKETS_MS = (5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000, 30000)


@dataclass
class Histogram:
    """A Prometheus histogram in milliseconds (cumulative buckets, sum, count)."""

    counts: list[int] = field(default_factory=lambda: [0] * (len(_BUCKETS_MS) + 1))
    total: float = 0.0

    def observe(self, ms: float) -> None:
        self.total += ms
        for i, edge in enumerate(_BUCKETS_MS):
            if ms <= edge:
                self.counts[i] += 1
                return
        self.counts[-1] += 1

    def lines(self, name: str, help_text: str) -> list[str]:
        out = [f"# HELP {name} {help_text}", f"# TYPE {name} histogram"]
        running = 0
        for edge, count in zip((*map(str, _BUCKETS_MS), "+Inf"), self.counts):
            running += count
            out.append(f'{name}_bucket{{le="{edge}"}} {running}')
        return out + [f"{name}_sum {self.total:.3f}", f"{name}_count {running}"]


@dataclass
class Metrics:
    counters: dict[str, float] = field(default_factory=lambda: dict.fromkeys(_COUNTERS, 0))
    latency: Histogram = field(default_factory=Histogram)
    ttft: Histogram = field(default_factory=Histogram)
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
            self.latency.observe(total_ms)
            self.ttft.observe(acc.ttft_ms)

    def record_error(self) -> None:
        with self._lock:
            self.counters["step_errors_total"] += 1

    def render(self, gauges: dict[str, float]) -> str:
        """Prometheus exposition text: counters, latency histograms and the given gauges."""
        lines = []
        with self._lock:
            for name, help_text in _COUNTERS.items():
                lines += [f"# HELP session_{name} {help_text}", f"# TYPE session_{name} counter",
                          f"session_{name} {self.counters[name]:g}"]
            lines += self.latency.lines("session_step_latency_ms", "Step latency as the HTTP layer saw it")
            lines += self.ttft.lines("session_ttft_ms", "Time to first token of each step")
        typed = set()
        for name, value in gauges.items():  # a name may carry labels: pool_free_tokens{worker="w0"}
            base = name.split("{", 1)[0]
            if base not in typed:
                typed.add(base)
                lines.append(f"# TYPE session_{base} gauge")
            lines.append(f"session_{name} {value:g}")
        return "\n".join(lines) + "\n"
