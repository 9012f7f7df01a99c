"""Template `hf`: a model folder's own chat template, token-identical to the
official rendering (the injection tests for every template, hf included, are in
test_template_fidelity.py).

The folders (hf_folders.py) hold the official templates of Qwen3, Qwen2.5,
Llama 3.3, gpt-oss and GLM-4.5 (tests/data/templates); the oracle renders the
same conversation with transformers as SGLang's server does and tokenizes it
whole. A conversation the official template refuses (Llama 3 and gpt-oss take
one tool call per message; gpt-oss refuses content and reasoning together on a
tool call) must be refused by ours with a clear error."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, assume, given, settings

from session_runtime.errors import InvalidRequest
from session_runtime.templates import build_template
from tests.session_runtime import fidelity
from tests.session_runtime.hf_folders import FAMILIES, family, write_folder

def deviates(name: str, conv) -> bool:
    """The listed deviations (README, Templates), both inside the open turn where
    the generated sequence wins: Qwen3's template drops an empty think block from
    every assistant step but the last; Qwen2.5's tokenizes content that starts
    with whitespace together with the generation prompt's newline (content "\\n"
    gives `assistant` + `\\n\\n\\n`, which a model continuing `assistant\\n` never
    generates)."""
    open_steps = conv[2][-1][1]
    return (name == "qwen3" and fidelity.qwen3_deviates(*conv)) or (
        name == "qwen2.5" and any(content[:1].isspace() for _, content, *_ in open_steps))


def check(name: str, conv) -> None:
    folder, tok, tpl = family(name)
    try:
        want = fidelity.hf_official(folder, tok, tpl, *conv)
    except Exception as exc:  # the official template refuses this shape
        with pytest.raises(InvalidRequest):
            fidelity.ours(tpl, *conv)
        return exc
    got = fidelity.ours(tpl, *conv)
    if got != want:
        i = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), min(len(want), len(got)))
        raise AssertionError(f"{name} at token {i}: official {tok.decode(want[max(0, i - 8):i + 8])!r}, "
                             f"ours {tok.decode(got[max(0, i - 8):i + 8])!r}")


@pytest.mark.parametrize("name", sorted(FAMILIES))
@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(conv=fidelity.conversations())
def test_hf_prompts_equal_the_official_template(name, conv):
    assume(not deviates(name, conv))
    check(name, conv)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(FAMILIES))
@settings(max_examples=1000, deadline=None, suppress_health_check=list(HealthCheck))
@given(conv=fidelity.conversations())
def test_hf_prompts_equal_the_official_template_1000(name, conv):
    assume(not deviates(name, conv))
    check(name, conv)


@pytest.mark.parametrize("name", sorted(FAMILIES))
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(conv=fidelity.conversations())
def test_a_growing_conversation_renders_as_a_fresh_template_renders_it(name, conv):
    """A conversation rendered turn after turn (the head's prefix checks kept
    from one turn to the next, so a turn renders only its own messages' prefixes)
    gives the same spans as a template that renders it for the first time:
    the open turn's prompt under drop, and the closed history a next turn forks from."""
    from session_runtime.templates import build_template as build

    folder, tok, _ = family(name)
    warm = build("hf", tok, str(folder))
    system, tools, turns = conv
    for k in range(1, len(turns) + 1):
        for closed in (False, True):
            fresh = build("hf", tok, str(folder))
            try:
                msgs = fidelity.messages(warm, turns[:k])
            except InvalidRequest:  # a shape the official template refuses (gpt-oss: content and thinking)
                return
            keep = (lambda turn: False) if closed else (lambda turn: turn == k - 1)
            try:
                want = fresh.render(system, tools, msgs, keep, not closed)
            except InvalidRequest:
                with pytest.raises(InvalidRequest):
                    warm.render(system, tools, msgs, keep, not closed)
                continue
            got = warm.render(system, tools, msgs, keep, not closed)
            assert (got.ids, got.spans) == (want.ids, want.spans)


@pytest.mark.parametrize("name,want,thinks", [("glm4.5", "hf", True), ("llama3", "hf", False), ("qwen3", "qwen3", True)])
def test_a_folder_is_served_with_its_own_chat_template(tmp_path, name, want, thinks):
    """`--template auto` (the default) picks `hf` for a folder whose chat template
    is not one a built-in template implements, and the built-in for Qwen3's
    official one. On `hf` a tool chain continues its exact sequence (each step
    reuses the whole previous prompt and output), and a new turn reuses the tree
    up to where the template drops the closed turn's reasoning."""
    from session_runtime.config import RuntimeConfig
    from session_runtime.runtime import Runtime
    from tests.session_runtime.test_weights import save_hf

    save_hf(tmp_path, "llama", vocab=151936, tied=False)
    write_folder(tmp_path, name)
    tools = [{"type": "function", "function": {"name": "f", "description": "Find.", "parameters": {
        "type": "object", "properties": {"q": {"type": "string"}}}}}]
    rt = Runtime(RuntimeConfig(model=str(tmp_path), pool_tokens=4096, max_context=2048, page_size=1), background=False)
    try:
        assert rt.config.template == want
        cid = rt.create_conversation(system="Be brief.", tools=tools)
        one = rt.send_message(cid, "Find x.", forced={"reasoning": "I should search." if thinks else "",
                                                       "tool_calls": [{"name": "f", "arguments": {"q": "x"}}]})
        assert [c["name"] for c in one.tool_calls] == ["f"] and one.reasoning == ("I should search." if thinks else "")
        two = rt.send_tool_results(cid, [{"tool_call_id": one.tool_calls[0]["id"], "content": "x is 42."}],
                                   forced={"reasoning": "Found it." if thinks else "", "content": "x is 42."})
        assert two.accounting.cached_input_tokens == one.accounting.prompt_tokens + one.accounting.output_tokens
        three = rt.send_message(cid, "Thanks.", max_tokens=3)
        assert three.accounting.output_tokens == 3
        assert 0 < three.accounting.cached_input_tokens < three.accounting.prompt_tokens
        rt.check_integrity()
    finally:
        rt.close()


def test_hf_without_a_folder_is_a_clear_error():
    from session_runtime.tokenizer import deepseek_tokenizer

    with pytest.raises(InvalidRequest, match="give --model a folder"):
        build_template("hf", deepseek_tokenizer(), "tiny")



def test_a_template_that_opens_think_parses_and_streams_the_output_as_reasoning_until_it_closes(tmp_path):
    """Qwen3's thinking models and DeepSeek-R1 end the generation prompt with
    `<think>\\n`: the output starts inside the block and has no `<think>` of
    its own. Until `</think>` every token is reasoning (a step cut off there has
    reasoning and no content), and a stream sends the reasoning as reasoning and
    then the whole answer, never the reasoning as text."""
    import json
    import queue

    from session_runtime.api.streaming import step_events
    from session_runtime.tokenizer import load_tokenizer

    write_folder(tmp_path, "qwen3")
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["chat_template"] = config["chat_template"].replace(
        "{{- '<|im_start|>assistant\\n' }}\n    {%- if enable_thinking",
        "{{- '<|im_start|>assistant\\n<think>\\n' }}\n    {%- if enable_thinking")
    assert "assistant\\n<think>\\n" in config["chat_template"]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tok = load_tokenizer(str(tmp_path))
    tpl = build_template("hf", tok, str(tmp_path))
    plain = build_template("hf", tok, str(write_folder(tmp_path / "plain", "qwen3")))
    assert tpl.opens_thinking and not plain.opens_thinking

    thinking = tok.inner.encode("Let me think about it.").ids
    answer = tok.inner.encode("The answer is 4.").ids
    end_think, im_end = tok.inner.token_to_id("</think>"), tok.inner.token_to_id("<|im_end|>")
    cut = tpl.parse_output(thinking, "c")
    assert (cut.reasoning, cut.content, list(cut.reasoning_ids)) == ("Let me think about it.", "", thinking)
    whole = thinking + [end_think] + tok.inner.encode("\n\n").ids + answer + [im_end]
    parsed = tpl.parse_output(whole, "c")
    assert (parsed.reasoning, parsed.content.strip(), parsed.ended) == ("Let me think about it.", "The answer is 4.", True)
    # Without the open block, text without `</think>` is the answer (a model that does not think).
    assert plain.parse_output(answer, "c").content == "The answer is 4."

    events: queue.Queue = queue.Queue()
    for token in whole:
        events.put(("token", token))
    step = type("S", (), {"reasoning": parsed.reasoning, "content": parsed.content})()
    events.put(("step", step))
    sent = {"reasoning": "", "content": ""}
    for kind, value in step_events(events, tpl, None, lambda: None):
        if kind in sent:
            sent[kind] += value
    assert sent == {"reasoning": parsed.reasoning, "content": parsed.content}


def test_templates_are_rendered_window_by_window_where_they_allow_it_and_whole_where_not(tmp_path):
    """The `hf` template renders a turn's messages in the window that opens at
    the turn's user message (its Jinja work in the turn's size, not the
    conversation's) only where the template was found to render so at load.
    One that numbers its messages (a window's index is not the whole
    conversation's) is rendered whole, and still as the official template
    renders it."""
    from session_runtime.tokenizer import load_tokenizer

    for name in ("qwen3", "glm4.5", "gpt-oss", "qwen2.5"):
        assert family(name)[2].windowed is not None, name
    assert family("llama3")[2].windowed is None  # its tools go into the first user message
    folder = write_folder(tmp_path, "qwen2.5")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = config["chat_template"].replace(
        "'<|im_start|>' + message.role + '\\n' + message.content", "'<|im_start|>' + message.role + '\\n' + "
        "(loop.index0 | string) + message.content")
    assert "loop.index0 | string" in config["chat_template"]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    tok = load_tokenizer(str(folder))
    tpl = build_template("hf", tok, str(folder))
    assert tpl.windowed is None
    conv = ("Be brief.", [], [("First?", [("", "One.", [], [])]), ("Second?", [("", "Two.", [], [])]), ("Third?", [])])
    assert fidelity.ours(tpl, *conv) == fidelity.hf_official(folder, tok, tpl, *conv)


def test_a_template_that_writes_the_date_writes_the_renderers_day_past_midnight(monkeypatch):
    """gpt-oss's template writes `strftime_now`'s date into every prompt. A
    server running past midnight must not render with another date than its
    earlier renders (memoized: a step's prompt, a forced output's generation
    prompt), or a prompt no longer starts as its own earlier prefix: the
    renderer's clock is the day it was built, whatever the real clock says."""
    import datetime as dt

    import transformers.utils.chat_template_utils as ctu

    folder, tok, tpl = family("gpt-oss")
    day = tpl.official.today.strftime("%Y-%m-%d")
    assert tpl.forced_ids("", "an answer")  # renders (and keeps) the generation prompt, dated
    before = tpl.official.text([{"role": "user", "content": "a question"}], [], True)
    assert day in before

    class Tomorrow(dt.datetime):
        @classmethod
        def now(cls, tz=None):
            return dt.datetime.now(tz) + dt.timedelta(days=1)

    monkeypatch.setattr(ctu, "datetime", Tomorrow)  # the real clock, past midnight
    assert tpl.forced_ids("", "another answer")  # its full render agrees with the kept generation prompt
    after = tpl.official.text([{"role": "user", "content": "a question"}, {"role": "assistant", "content": "ok"},
                               {"role": "user", "content": "and then"}], [], True)
    assert day in after and after.startswith(before[:before.index("a question")])
