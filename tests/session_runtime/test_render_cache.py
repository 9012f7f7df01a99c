"""A render that extends an earlier one (render_cache.py) is the render from
scratch: over conversations grown step by step the way the runtime grows
them (appended messages, a turn's close that drops its reasoning, runs of
tool results that go on, another system prompt, keep rules that move), each
template's cached rendering equals a fresh template's, ids and spans."""

from __future__ import annotations

import dataclasses
import random

import pytest

from session_runtime.templates import DeepSeekTemplate, Message, ToolCall
from session_runtime.templates.qwen3 import Qwen3Template
from session_runtime.tokenizer import deepseek_tokenizer, qwen3_tokenizer
from session_runtime.templates.render_cache import _kept
from session_runtime.turns import keep_all, keep_from

MAKERS = {"deepseek": (DeepSeekTemplate, deepseek_tokenizer), "qwen3": (Qwen3Template, qwen3_tokenizer)}


def _assistant(tpl, rng: random.Random, turn: int, calls: bool) -> Message:
    call = (ToolCall(f"call_{turn}_{rng.randrange(99)}", "calc", {"x": rng.randrange(9)}),) if calls else ()
    reasoning, content = f"Think {rng.randrange(999)}.", "" if calls else f"Answer {rng.randrange(999)}."
    ids = tpl.forced_ids(reasoning, content, call)
    return Message("assistant", turn, content=content, reasoning=reasoning, tool_calls=call, output_ids=tuple(ids))


@pytest.mark.parametrize("name", sorted(MAKERS))
@pytest.mark.parametrize("seed", range(3))
def test_a_cached_render_is_the_render_from_scratch(name, seed):
    make, tokenizer = MAKERS[name]
    tok = tokenizer()
    cached = make(tok)
    rng = random.Random(seed)
    system, tools = "Be brief.", [{"type": "function", "function": {"name": "calc"}}]
    history: list[Message] = []
    for turn in range(12):
        if rng.random() < 0.1:
            system = f"System {turn}."
        if rng.random() < 0.1:
            tools = [*tools, {"type": "function", "function": {"name": f"f{turn}"}}]
        new = [Message("user", turn, f"Question {turn}?")]
        for _ in range(rng.randrange(3)):  # a tool chain; its results arrive one render at a time
            new.append(_assistant(cached, rng, turn, calls=True))
            new += [Message("tool", turn, f"result {i}", tool_call_id=f"call_{i}") for i in range(rng.randrange(1, 3))]
        new.append(_assistant(cached, rng, turn, calls=False))
        for cut in range(1, len(new) + 1):
            messages = history + new[:cut]
            for keep in (keep_all, keep_from(turn), keep_from(max(0, turn - 2))):
                # Which turns keep their reasoning, found by bisection: what asking each message says.
                assert _kept(keep, messages) == [keep(m.turn) for m in messages]
                for generation_prompt in (True, False):
                    before = cached.rendered_length(system, tools, messages, keep, generation_prompt)
                    got = cached.render(system, tools, messages, keep, generation_prompt)
                    want = make(tok).render(system, tools, messages, keep, generation_prompt)
                    assert (got.ids, got.spans) == (want.ids, want.spans), (turn, cut)
                    # The length alone, from what the cache holds (or rendered, where it holds none).
                    after = cached.rendered_length(system, tools, messages, keep, generation_prompt)
                    assert before == after == len(want.ids), (turn, cut, generation_prompt)
                    got.ids.append(-1)  # what a caller does to its copy does not reach the cache
        # The turn closes: its reasoning is dropped from the history (new message objects).
        history = [m if m.turn != turn or not m.reasoning or rng.random() < 0.3 else cached.strip_reasoning(m)
                   for m in history + new]
        if rng.random() < 0.2:  # a client's own copy of the same history: equal messages, other objects
            history = [dataclasses.replace(m) for m in history]


def test_kept_flags_of_a_history_out_of_turn_order_ask_each_message():
    messages = [Message("user", t, "x") for t in (0, 2, 1, 3)]
    assert _kept(keep_from(2), messages) == [False, True, False, True]
    assert _kept(lambda t: t % 2 == 0, messages) == [True, True, False, False]


@pytest.mark.parametrize("name", sorted(MAKERS))
def test_messages_out_of_turn_order_render_as_from_scratch(name, monkeypatch):
    """Keep flags compared by bisection only where the turns are in order: a
    history out of turn order (and a rule that is not a threshold) asks each
    message, and still renders as a fresh template does."""
    make, tokenizer = MAKERS[name]
    tok = tokenizer()
    cached = make(tok)
    turns = [0, 2, 1, 3, 3, 5, 4, 6]
    history: list[Message] = []
    for k, t in enumerate(turns):
        history += [Message("user", t, f"Q{k}?"), _assistant(cached, random.Random(k), t, calls=False)]
        for keep in (keep_from(2), keep_from(4), keep_all, lambda turn: turn % 2 == 0, keep_from(2)):
            for generation_prompt in (True, False):
                got = cached.render("S.", [], history, keep, generation_prompt)
                want = make(tok).render("S.", [], history, keep, generation_prompt)
                assert (got.ids, got.spans) == (want.ids, want.spans), (k, keep)


def test_a_history_in_turn_order_under_thresholds_builds_no_keep_flags(monkeypatch):
    """The runtime's case: thresholds that move as turns close, over a history
    in turn order: the renders never build a list of per-message flags."""
    import session_runtime.templates.render_cache as rc

    cached = DeepSeekTemplate(deepseek_tokenizer())
    built = []
    monkeypatch.setattr(rc, "_kept", lambda keep, messages: built.append(len(messages)) or [])
    history: list[Message] = []
    for turn in range(6):
        history = history + [Message("user", turn, f"Q{turn}?")]
        for keep in (keep_from(turn), keep_from(max(0, turn - 1)), keep_all):
            cached.render("S.", [], history, keep, True)
        history = history + [_assistant(cached, random.Random(turn), turn, calls=False)]
        cached.render("S.", [], history, keep_from(turn + 1), False)
    assert built == []


@pytest.mark.parametrize("name", sorted(MAKERS))
def test_the_history_length_a_step_asks_is_read_from_the_prompt_it_rendered(name, monkeypatch):
    """A step renders its prompt (history + the new message), then asks the
    history's length: read from the prompt's kept rendering, no render (no
    copy of the conversation's ids)."""
    make, tokenizer = MAKERS[name]
    tpl = make(tokenizer())
    rng = random.Random(0)
    history = [m for t in range(6) for m in (Message("user", t, f"Q {t}?"), _assistant(tpl, rng, t, calls=False))]
    new = [Message("user", 6, "Q 6?")]
    keep, tools = keep_from(6), []  # the conversation's own tools list
    prompt = tpl.render("Be brief.", tools, history + new, keep, True)
    want = len(make(tokenizer()).render("Be brief.", tools, history, keep, False).ids)
    monkeypatch.setattr(tpl._renders, "render", lambda *a, **k: pytest.fail("rendered again"))
    assert tpl.rendered_length("Be brief.", tools, history, keep, False) == want < len(prompt.ids)
