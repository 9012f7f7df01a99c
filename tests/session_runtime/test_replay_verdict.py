"""The replay's verdict: each policy's full cost at a stated price of a KV
token-second, the cheapest, keep's break-even price against each other run;
and the report's notes: another tokenizer's vocabulary, files that are not
traces (`--skip-bad`), a trace without reasoning. The command runs with
`--no-model` (test_replay_no_model.py shows it gives the model's numbers)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from session_runtime.cli import main
from session_runtime.config import PRESETS
from session_runtime.cost_model import CostModel, default_kv_price
from session_runtime.replay.economics import break_even, full_cost, verdict

TRACE = Path(__file__).resolve().parents[2] / "examples" / "sample_trace.jsonl"


def totals(flops: float, kv_token_seconds: float, idle: float = 0.0) -> dict:
    return {"request_flops": flops, "idle_flops": idle, "kv_token_seconds": kv_token_seconds}


def test_break_even_and_the_cheapest_by_hand():
    keep, drop = totals(100.0, 50.0), totals(130.0, 20.0)  # keep: fewer FLOPs, more KV
    price, meaning = break_even(keep, drop)
    assert price == pytest.approx(1.0)  # 100 + 50p = 130 + 20p
    assert meaning == "keep is cheaper below it, drop above it"
    assert full_cost(keep, 1.0) == pytest.approx(full_cost(drop, 1.0))
    rows = [("keep", "keep", keep), ("drop:never", "drop", drop)]
    assert verdict(rows, 0.5)["cheapest"] == "keep" and verdict(rows, 2.0)["cheapest"] == "drop:never"
    v = verdict(rows, 2.0)
    assert v["runs"]["drop:never"] == {"flops": 130.0, "kv_token_seconds": 20.0, "kv_flops": 40.0,
                                       "cost_flops": 170.0}
    assert v["break_even"]["drop:never"] == {"kv_price_flops": pytest.approx(1.0),
                                             "meaning": "keep is cheaper below it, drop:never above it"}
    # One that needs no more FLOPs and holds no more KV is cheaper at every price.
    assert break_even(keep, totals(90.0, 40.0)) == (None, "drop is cheaper at every price (no fewer FLOPs and no "
                                                          "more KV)")
    # Idle-time FLOPs count; a branch built after the last turn is not in idle_flops.
    assert full_cost(totals(100.0, 10.0, idle=5.0), 2.0) == 125.0


def test_the_default_price_says_what_it_assumes():
    cm = CostModel("qwen3-8b", PRESETS["qwen3-8b"])
    # A GPU-second of compute (40% of an H100's bf16 peak) = holding its 80 GB for a second.
    assert default_kv_price(cm) == pytest.approx(0.4 * 989e12 * cm.kv_bytes_per_token / 80e9)


def test_the_report_gives_a_verdict_and_its_notes(tmp_path, capsys):
    folder = tmp_path / "traces"
    folder.mkdir()
    (folder / "agent.jsonl").write_text(TRACE.read_text())
    (folder / "notes.json").write_text('{"not": "a trace"}')
    plain = [{"type": "conversation", "system": "No reasoning here."},
             {"role": "user", "content": "Hello."}, {"role": "assistant", "content": "Hi."},
             {"role": "user", "content": "Again."}, {"role": "assistant", "content": "Hi again."},
             {"role": "user", "content": "Bye."}, {"role": "assistant", "content": "Bye."}]
    (folder / "plain.jsonl").write_text("\n".join(json.dumps(m) for m in plain) + "\n")
    args = ["replay", str(folder), "--no-model", "--policy", "keep", "--policy", "drop:never", "--no-progress",
            "--cost-model", "qwen3-8b"]
    # A file that is not a trace stops the batch, unless --skip-bad.
    assert main(args) == 2
    assert "notes.json" in capsys.readouterr().err
    report = tmp_path / "report.json"
    assert main([*args, "--skip-bad", "--kv-price", "1e8", "--json", str(report)]) == 0
    out = capsys.readouterr().out
    assert "skipped (not a trace): " in out and "notes.json" in out
    assert "warning: the token counts come from the deepseek tokenizer (129280 ids" in out
    assert "priced as qwen3-8b (151936 ids)" in out
    assert "== verdict: a KV token-second costs 1e+08 FLOPs (--kv-price) ==" in out
    assert "keep vs drop:never: break-even at" in out
    assert "the trace has no reasoning, yet the dropping policies prefill more than keep" in out
    data = json.loads(report.read_text())
    assert len(data["skipped"]) == 1 and "notes.json" in data["skipped"][0]
    agg = data["aggregate_verdict"]
    assert agg["kv_price_flops"] == 1e8 and agg["cheapest"] in ("keep", "drop:never")
    assert sum(agg["cheapest_in_traces"].values()) == 2
    for trace in data["traces"]:
        v = trace["economics"]["verdict"]
        assert v["kv_price_source"] == "--kv-price" and set(v["runs"]) == {"keep", "drop:never"}
    assert main([*args, "--kv-price", "-1"]) == 2
