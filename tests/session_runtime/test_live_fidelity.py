"""The prompts the runtime itself sends to the engine, step by step, equal the
official renderings of the conversation so far (drop policy).

The steps run through `Runtime` on the embedded engine with forced outputs (the
replay path: the ids are the template's own writing of each output), so every
layer takes part: the conversation's history, reasoning stripped at each turn's
close, the fork. The prompts are read where the backend receives them."""

from __future__ import annotations

from pathlib import Path

import pytest

from session_runtime.config import RuntimeConfig
from session_runtime.runtime import Runtime
from session_runtime.templates.base import ToolCall
from tests.session_runtime import fidelity
from tests.session_runtime.hf_folders import write_folder

TOOLS = [{"type": "function", "function": {"name": "f", "description": "Find things.", "parameters": {
    "type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}}}]
# (user, [(reasoning, content, calls, results)]) per turn; the last step of each turn answers.
TURNS = [("Find x, then y.", [("I search x.", "", [ToolCall("", "f", {"q": "x"})], ["x is 1."]),
                              ("Now y.", "", [ToolCall("", "f", {"q": "y"})], ["y is 2."]),
                              ("Both found.", "x is 1, y is 2.", [], [])]),
         ("Thanks. And z?", [("Search z.", "", [ToolCall("", "f", {"q": "z"})], ["z is 3."]),
                             ("Done.", "z is 3.", [], [])]),
         ("Bye.", [("Short.", "Bye!", [], [])])]


def _runtime(tmp_path, name: str) -> Runtime:
    if name == "deepseek":
        return Runtime(RuntimeConfig(model="tiny", template="deepseek", pool_tokens=4096, max_context=2048),
                       background=False)
    from tests.session_runtime.test_weights import save_hf

    save_hf(tmp_path, "llama", vocab=151936, tied=False)
    write_folder(tmp_path, name)
    return Runtime(RuntimeConfig(model=str(tmp_path), pool_tokens=4096, max_context=2048), background=False)


def _official(rt: Runtime, name: str, conv) -> list[int]:
    tpl = rt.template(rt.config.template)
    if name == "deepseek":
        return fidelity.deepseek_official(rt.tokenizer, *conv)
    if name == "qwen3":
        return fidelity.qwen3_official(rt.tokenizer, *conv)
    return fidelity.hf_official(Path(rt.config.model), rt.tokenizer, tpl, *conv)


@pytest.mark.parametrize("name", ["deepseek", "qwen3", "glm4.5", "gpt-oss", "llama3"])
def test_every_prompt_the_runtime_sends_is_the_official_one(tmp_path, name):
    rt = _runtime(tmp_path, name)
    prompts: list[list[int]] = []
    step = rt.backend.step
    rt.backend.step = lambda req: prompts.append(list(req.prompt)) or step(req)  # observe, then run
    thinks = name != "llama3"  # Llama 3's template has no reasoning
    try:
        cid = rt.create_conversation(system="Be brief.", tools=TOOLS, policy="drop")
        done: list = []  # the conversation so far, as fidelity.py writes it
        for user, steps in TURNS:
            open_steps: list = []
            for k, (reasoning, content, calls, results) in enumerate(steps):
                reasoning = reasoning if thinks else ""
                forced = {"reasoning": reasoning, "content": content,
                          "tool_calls": [{"name": c.name, "arguments": c.arguments} for c in calls]}
                if k == 0:
                    out = rt.send_message(cid, user, forced=forced)
                else:
                    prev = open_steps[-1]
                    out = rt.send_tool_results(cid, [{"tool_call_id": c.id, "content": r}
                                                     for c, r in zip(prev[2], prev[3])], forced=forced)
                want = _official(rt, name, ("Be brief.", TOOLS, [*done, (user, open_steps)]))
                assert prompts[-1] == want, f"turn {len(done)} step {k}: {rt.tokenizer.decode(prompts[-1])!r}"
                ids = [ToolCall(c["id"], c["name"], c["arguments"]) for c in out.tool_calls]
                open_steps.append((reasoning, content, ids, results))
            done.append((user, open_steps))
        rt.check_integrity()
    finally:
        rt.close()
