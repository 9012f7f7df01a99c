"""/metrics in the Prometheus text format (version 0.0.4), by its conventions.

Every family is `session_runtime_<name>`, with a HELP and a TYPE line. Running
totals are counters whose names end in `_total`; instantaneous values are
gauges; durations are in seconds and sizes in bytes or tokens, named so
(`..._seconds`, `..._bytes`, `..._tokens`). The step counters and latency
histograms live here; the runtime and each backend describe their own figures
as `Sample`s (`metric_samples()`).
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field
from typing import Iterable, Literal

from session_runtime.accounting import StepAccounting

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
}

_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


@dataclass
class Histogram:
    """A Prometheus histogram in seconds (cumulative buckets, sum, count)."""

    counts: list[int] = field(default_factory=lambda: [0] * (len(_BUCKETS_S) + 1))
    total_s: float = 0.0

    def observe(self, seconds: float) -> None:
        self.total_s += seconds
        for i, edge in enumerate(_BUCKETS_S):
            if seconds <= edge:
                self.counts[i] += 1
                return
        self.counts[-1] += 1

    def lines(self, name: str, help_text: str) -> list[str]:
        out = [f"# HELP {name} {_escape_help(help_text)}", f"# TYPE {name} histogram"]
        running = 0
        for edge, count in zip((*map(repr, _BUCKETS_S), "+Inf"), self.counts):
            running += count
            out.append(f'{name}_bucket{{le="{edge}"}} {running}')
        return out + [f"{name}_sum {_number(self.total_s)}", f"{name}_count {running}"]


@dataclass
class Metrics:
    """The HTTP layer's step counters and latency histograms (thread-safe)."""

    counters: dict[str, float] = field(default_factory=lambda: dict.fromkeys(_COUNTERS, 0))
    latency: Histogram = field(default_factory=Histogram)
    ttft: Histogram = field(default_factory=Histogram)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def record_step(self, acc: StepAccounting, total_ms: float) -> None:
        """Count a step that succeeded; `total_ms` is its latency as the HTTP layer saw it."""
        with self._lock:
            c = self.counters
            c["steps_total"] += 1
            c["prompt_tokens_total"] += acc.prompt_tokens
            c["cached_input_tokens_total"] += acc.cached_input_tokens or 0  # None: an upstream that does not say
            c["prefill_tokens_total"] += acc.uncached_prefill_tokens or 0
            c["recomputed_history_tokens_total"] += acc.recomputed_history_tokens
            c["output_tokens_total"] += acc.output_tokens
            self.latency.observe(total_ms / 1e3)
            self.ttft.observe(acc.ttft_ms / 1e3)

    def record_error(self) -> None:
        with self._lock:
            self.counters["step_errors_total"] += 1

    def render(self, samples: Iterable[Sample]) -> str:
        """The exposition text: the step counters, the latency histograms, then
        `samples` grouped into families (one HELP and TYPE line each)."""
        with self._lock:
            lines = []
            for name, help_text in _COUNTERS.items():
                value = _number(self.counters[name])
                lines += _family(PREFIX + name, help_text, "counter", [f"{PREFIX}{name} {value}"])
            lines += self.latency.lines(f"{PREFIX}step_latency_seconds", "Step latency as the HTTP layer saw it")
            lines += self.ttft.lines(f"{PREFIX}time_to_first_token_seconds", "Time to first token of each step")
        families: dict[str, list[Sample]] = {}
        for s in samples:  # a family's series must be consecutive: group them
            families.setdefault(s.name, []).append(s)
        for name, series in families.items():
            first = series[0]
            assert all((s.kind, s.help) == (first.kind, first.help) for s in series), f"{name}: mixed kind or help"
            lines += _family(PREFIX + name, first.help, first.kind,
                             [f"{PREFIX}{name}{_labels(s.labels)} {_number(s.value)}" for s in series])
        return "\n".join(lines) + "\n"


def _family(name: str, help_text: str, kind: str, series: list[str]) -> list[str]:
    return [f"# HELP {name} {_escape_help(help_text)}", f"# TYPE {name} {kind}", *series]


def _labels(labels: tuple[tuple[str, str], ...]) -> str:
    if not labels:
        return ""
    return "{" + ",".join(f'{k}="{_escape_label(str(v))}"' for k, v in labels) + "}"


def _escape_help(text: str) -> str:
    return text.replace("\\", r"\\").replace("\n", r"\n")


def _escape_label(text: str) -> str:
    return _escape_help(text).replace('"', r"\"")


def _number(value: float) -> str:
    """Integers exactly (`:g` would print 1.23457e+07), other floats in full."""
    if isinstance(value, int) or (math.isfinite(value) and float(value).is_integer() and abs(value) < 2**53):
        return str(int(value))
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))
