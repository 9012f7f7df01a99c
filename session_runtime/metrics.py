"""/metrics in the Prometheus text format (version 0.0.4), written by
`prometheus_client`, by Prometheus' conventions.

Every family is `session_runtime_<name>`, with a HELP and a TYPE line. Running
totals are counters whose names end in `_total`; instantaneous values are
gauges; durations are in seconds and sizes in bytes or tokens, named so
(`..._seconds`, `..._bytes`, `..._tokens`). The step counters, the uncached
tokens by reason and the latency histograms live here, in a registry of their
own; the runtime and each backend describe their figures at scrape time as
`Sample`s (`metric_samples()`), which a collector turns into families.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Literal

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.metrics_core import Metric

from session_runtime.accounting import StepAccounting
from session_runtime.uncached import REASONS

# One series per value: no `_created` timestamps beside counters and histograms.
prometheus_client.disable_created_metrics()

PREFIX = "session_runtime_"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


@dataclass(frozen=True)
class Sample:
    """One series: `name` without the prefix, `value` in base units, and its
    family's `help` and `kind`; `labels` as (name, value) pairs."""

    name: str
    value: float
    help: str
    kind: Literal["counter", "gauge"] = "gauge"
    labels: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        assert self.kind in ("counter", "gauge"), f"{self.name}: kind {self.kind!r}"
        # The suffix is the type's promise: a `_total` never goes down, a gauge may.
        assert (self.kind == "counter") == self.name.endswith("_total"), (
            f"{self.name}: counters, and only counters, end in _total")

    def labelled(self, **labels: str) -> Sample:
        return Sample(self.name, self.value, self.help, self.kind, (*self.labels, *labels.items()))


def gauge(name: str, value: float, help_text: str) -> Sample:
    return Sample(name, value, help_text, "gauge")


def counter(name: str, value: float, help_text: str) -> Sample:
    return Sample(name, value, help_text, "counter")


_COUNTERS = {
    "steps_total": "Steps run",
    "prompt_tokens_total": "Prompt tokens over all steps",
    "cached_input_tokens_total": "Prompt tokens whose device KV was reused",
    "prefill_tokens_total": "Prompt tokens computed by prefill",
    "recomputed_history_tokens_total": "Prefill spent on history tokens",
    "output_tokens_total": "Tokens generated or forced",
    "step_errors_total": "Steps that failed with a client or pool error",
    "gemini_signature_skips_total": "Gemini function calls of a current turn sent back with a documented skip "
                                    "value instead of this server's thought signature",
}

_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class Metrics:
    """The HTTP layer's step counters and latency histograms (thread-safe:
    prometheus_client's metrics lock themselves)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.counters = {name: Counter(PREFIX + name, text, registry=self.registry)
                         for name, text in _COUNTERS.items()}
        self.uncached = Counter(PREFIX + "uncached_tokens_total",
                                "Prompt tokens computed by prefill, by why they were not cached",
                                ["reason"], registry=self.registry)
        for reason in REASONS:  # every reason is a series from the start, at 0
            self.uncached.labels(reason)
        self.latency = Histogram(PREFIX + "step_latency_seconds", "Step latency as the HTTP layer saw it",
                                 buckets=_BUCKETS_S, registry=self.registry)
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Time to first token of each step",
                              buckets=_BUCKETS_S, registry=self.registry)

    def record_step(self, acc: StepAccounting, total_ms: float) -> None:
        """Count a step that succeeded; `total_ms` is its latency as the HTTP layer saw it."""
        c = self.counters
        c["steps_total"].inc()
        c["prompt_tokens_total"].inc(acc.prompt_tokens)
        c["cached_input_tokens_total"].inc(acc.cached_input_tokens or 0)  # None: an upstream that does not say
        c["prefill_tokens_total"].inc(acc.uncached_prefill_tokens or 0)
        c["recomputed_history_tokens_total"].inc(acc.recomputed_history_tokens)
        c["output_tokens_total"].inc(acc.output_tokens)
        for entry in acc.uncached or ():
            self.uncached.labels(entry["reason"]).inc(entry["tokens"])
        self.latency.observe(total_ms / 1e3)
        self.ttft.observe(acc.ttft_ms / 1e3)

    def record_error(self) -> None:
        self.counters["step_errors_total"].inc()

    def render(self, samples: Iterable[Sample]) -> str:
        """The exposition text: the step counters, the uncached reasons, the
        latency histograms, then `samples` grouped into families."""
        scraped = CollectorRegistry(auto_describe=False)
        scraped.register(_SampleCollector(list(samples)))
        return (prometheus_client.generate_latest(self.registry)
                + prometheus_client.generate_latest(scraped)).decode()


class _SampleCollector:
    """`Sample`s as prometheus_client families: one per name, its series together."""

    def __init__(self, samples: list[Sample]):
        self.samples = samples

    def collect(self) -> Iterable[Metric]:
        families: dict[str, list[Sample]] = {}
        for s in self.samples:
            families.setdefault(s.name, []).append(s)
        for name, series in families.items():
            first = series[0]
            assert all((s.kind, s.help) == (first.kind, first.help) for s in series), f"{name}: mixed kind or help"
            family = Metric(PREFIX + name.removesuffix("_total"), first.help, first.kind)
            for s in series:
                family.add_sample(PREFIX + name, dict(s.labels), s.value)
            yield family
