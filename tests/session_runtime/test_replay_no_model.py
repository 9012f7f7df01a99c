"""`replay --no-model` gives the model run's numbers, token for token: every
policy, page sizes 1 and 16, the tool-heavy sample trace (5 turns, 14 steps,
13 tool calls). Only the timings differ. A step that would sample is refused
with a clear message."""

from __future__ import annotations

from pathlib import Path

import pytest

from session_runtime import Runtime, RuntimeConfig
from session_runtime.cli import main
from session_runtime.errors import InvalidRequest
from session_runtime.replay import load_trace
from session_runtime.replay.run import COMPARE, replay

TRACE = Path(__file__).resolve().parents[2] / "examples" / "sample_trace.jsonl"
TIMINGS = ("prefill_ms", "ttft_ms", "tpot_ms")
SPECS = (*COMPARE, "drop")  # drop: materialize auto, decided per turn


def numbers(result) -> dict:
    """A replay's every figure but its timings and random ids."""
    out = result.as_dict()
    del out["conversation_id"], out["tenant"]
    for turn in out["turns"]:
        for step in turn["step_accounting"]:
            for key in TIMINGS:
                del step[key]
    return out


def runtime(page: int, run_model: bool) -> Runtime:
    return Runtime(RuntimeConfig(model="tiny", page_size=page, pool_tokens=16384, max_context=8192,
                                 run_model=run_model), background=False)


@pytest.mark.parametrize("page", [1, 16])
def test_no_model_gives_the_model_runs_numbers_for_every_policy(page):
    trace = load_trace(TRACE)
    got = {}
    for run_model in (True, False):
        rt = runtime(page, run_model)
        try:
            got[run_model] = [numbers(replay(rt, trace, spec)) for spec in SPECS]
        finally:
            rt.close()
    for with_model, without in zip(got[True], got[False]):
        assert without == with_model, with_model["label"]
    # Not a vacuous equality: the policies differ, and the trace reuses and forks.
    totals = {r["label"]: r["totals"] for r in got[False]}
    assert totals["keep"]["prefill"] < totals["drop:never"]["prefill"]
    assert totals["drop:always"]["materialized"] > 0


def test_a_step_that_would_sample_is_refused():
    rt = runtime(16, False)
    try:
        cid = rt.create_conversation(system="No model here.")
        with pytest.raises(InvalidRequest, match="runs no model"):
            rt.send_message(cid, "Say something.", max_tokens=3)
        assert rt.send_message(cid, "Say this.", forced={"content": "This."}).content == "This."
    finally:
        rt.close()


def test_the_command_says_it_ran_no_model(capsys):
    assert main(["replay", str(TRACE), "--no-model", "--policy", "keep", "--policy", "drop", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "(its shape only: --no-model)" in out and "why each prefilled token was prefilled" in out
