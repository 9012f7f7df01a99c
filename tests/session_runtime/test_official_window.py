"""OfficialRenderer's windowed rendering (templates/official.py): a conversation
that extends one rendered before is rendered through a window of its last
turns. The oracle is the template rendering the whole conversation, as
transformers does: every prefix of long conversations, rendered in order by one
renderer, equals that rendering in text and control positions, for the five
official templates and for templates that count or number messages (which the
window's check must send to a whole rendering)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from session_runtime.templates.official import OfficialRenderer
from tests.session_runtime import fidelity
from tests.session_runtime.hf_folders import FAMILIES, family


@st.composite
def long_conversations(draw):
    """A system prompt, tools and 4-8 closed turns (joined from fidelity's conversations)."""
    system, tools, turns = draw(fidelity.conversations())
    while len(turns) < draw(st.integers(4, 8)):
        _, _, more = draw(fidelity.conversations())
        turns = [*turns, *more]
    return system, tools, turns


def _renderer(name: str, template: str = None) -> OfficialRenderer:
    _, tok, tpl = family(name)
    return OfficialRenderer(template or tpl.official.chat_template, tok, tpl.official.kwargs)


def _prefixes_match(r: OfficialRenderer, dicts: list, tools: list) -> int:
    """Render every prefix in order with `r` and compare with a whole rendering;
    returns how many were rendered through a window."""
    windowed = 0
    for n in range(1, len(dicts) + 1):
        for gen in (False, True):
            fresh = _renderer_like(r)
            try:
                want = fresh._render_key(dicts[:n], tools, gen)
            except Exception:  # a prefix the template refuses alone (Llama 3's tools need a user message)
                continue
            before = r._windowed(dicts[:n], tools, gen) if not gen else None
            got = r.render(dicts[:n], tools, gen)
            windowed += before is not None
            assert (got.text, got.controls) == (want.text, want.controls), (n, gen)
    return windowed


def _renderer_like(r: OfficialRenderer) -> OfficialRenderer:
    return OfficialRenderer(r.chat_template, r.tok, r.kwargs)


@pytest.mark.parametrize("name", sorted(FAMILIES))
@settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck))
@given(conv=long_conversations())
def test_every_prefix_renders_as_the_whole_template_renders_it(name, conv):
    system, tools, turns = conv
    dicts = fidelity.official_messages(system, tools, turns)
    _prefixes_match(_renderer(name), dicts, tools)


def _chat(turns: int) -> list[dict]:
    out = [{"role": "system", "content": "be brief"}]
    for t in range(turns):
        out += [{"role": "user", "content": f"question {t} about things"},
                {"role": "assistant", "content": f"answer {t}", "reasoning_content": f"thought {t}"}]
    return out


def test_a_long_chat_is_rendered_through_windows():
    """Qwen3's template over 12 turns: after the first turns every prefix is a window."""
    r = _renderer("qwen3")
    windowed = _prefixes_match(r, _chat(12), [])
    assert windowed >= 18


COUNTING = {
    "numbered": ("{% for m in messages %}<|im_start|>{{ m.role }} #{{ loop.index }}\n{{ m.content }}<|im_end|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"),
    "counted": ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant ({{ messages | length }} before)\n{% endif %}"),
    "first_user_marked": ("{% set ns = namespace(seen=false) %}{% for m in messages %}<|im_start|>{{ m.role }}\n"
                          "{% if m.role == 'user' and not ns.seen %}[first] {% set ns.seen = true %}{% endif %}"
                          "{{ m.content }}<|im_end|>\n{% endfor %}"
                          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"),
}


@pytest.mark.parametrize("kind", sorted(COUNTING))
def test_templates_that_count_messages_render_whole(kind):
    """A template whose text depends on a message's place (its number, the count
    of messages, the first user message marked) fails the window's check where
    a window would differ, and is rendered whole: every prefix still equals the
    whole rendering."""
    _prefixes_match(_renderer("qwen3", COUNTING[kind]), _chat(8), [])
