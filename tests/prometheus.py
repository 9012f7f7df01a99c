"""Read /metrics text with Prometheus' own parser, checking our conventions on
the way: every family prefixed, with a HELP and a TYPE line, counters ending in
`_total`, each family once (its series consecutive)."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

PREFIX = "session_runtime_"


def parse(text: str) -> dict[str, float]:
    """Every series by its name and labels (`x{worker="w0"}`, `x_bucket{le="0.5"}`)."""
    assert text.endswith("\n"), "the exposition ends with a newline"
    families = list(text_string_to_metric_families(text))
    names = [f.name for f in families]
    assert len(names) == len(set(names)), f"a family appears twice (series not consecutive): {names}"
    out: dict[str, float] = {}
    for f in families:
        # A series outside its family parses as an untyped family of its own, with no HELP.
        assert f.type in ("counter", "gauge", "histogram"), f"{f.name}: no TYPE line ({f.type})"
        assert f.documentation, f"{f.name}: no HELP line"
        assert f.name.startswith(PREFIX), f"{f.name}: not prefixed {PREFIX}"
        for s in f.samples:
            if f.type == "counter":
                assert s.name.endswith("_total") and not f.name.endswith("_total"), f"counter {s.name}"
            else:
                assert not s.name.endswith("_total"), f"{f.type} {s.name} ends in _total"
            labels = ",".join(f'{k}="{v}"' for k, v in s.labels.items())
            key = f"{s.name}{{{labels}}}" if labels else s.name
            assert key not in out, f"series {key} twice"
            out[key] = s.value
    # The parser is lax about what it skips; every line must be a comment it read or a series.
    series_lines = [line for line in text.splitlines() if line and not line.startswith("#")]
    assert len(series_lines) == len(out), "a line the parser did not read as a series"
    comment_lines = [line for line in text.splitlines() if line.startswith("#")]
    assert len(comment_lines) == 2 * len(families), "exactly one HELP and one TYPE line per family"
    return out
