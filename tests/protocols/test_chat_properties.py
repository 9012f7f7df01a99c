"""Property tests: any well-formed chat body round-trips byte for byte, and
strip() never changes its input and always sends a lenient or untouched shape
that DeepSeek's validator accepts whenever the input was accepted."""

from __future__ import annotations

import copy
import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from session_runtime.protocols import StripOptions, get_protocol

DEEPSEEK = get_protocol("deepseek")
CHAT = get_protocol("openai-chat")

text = st.text(max_size=8)
json_value = st.recursive(st.none() | st.booleans() | st.integers() | text,
                          lambda inner: st.lists(inner, max_size=2) | st.dictionaries(text, inner, max_size=2),
                          max_leaves=4)
content = st.none() | text | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": text}), max_size=2)
extra_keys = st.dictionaries(st.sampled_from(["name", "refusal", "annotations", "audio", "x_custom"]), json_value,
                             max_size=2)
call = st.builds(lambda i, name, args, more: {"id": f"call_{i}", "type": "function",
                                              "function": {"name": name, "arguments": args}, **more},
                 st.integers(0, 99), text, text, st.dictionaries(st.just("index"), st.integers(0, 3), max_size=1))


@st.composite
def message(draw, reasoning_fields: tuple[str, ...]):
    role = draw(st.sampled_from(["system", "user", "assistant", "tool"]))
    m: dict = {}
    fields = [("role", role)]
    if draw(st.booleans()) or role != "assistant":
        fields.append(("content", draw(content)))
    if role == "assistant":
        for name in reasoning_fields:
            if draw(st.booleans()):
                fields.append((name, draw(st.none() | text)))
        if draw(st.booleans()):
            fields.append(("tool_calls", draw(st.none() | st.lists(call, max_size=2))))
    if role == "tool":
        fields.append(("tool_call_id", draw(text)))
    fields += list(draw(extra_keys).items())
    for key, value in draw(st.permutations(fields)):
        m[key] = value
    return m


def body(reasoning_fields: tuple[str, ...]):
    return st.builds(lambda msgs, extra: {"model": "m", "messages": msgs, **extra},
                     st.lists(message(reasoning_fields), max_size=6),
                     st.dictionaries(st.sampled_from(["thinking", "tools", "max_tokens"]), json_value, max_size=2))


FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FAST
@given(body(("reasoning_content",)))
def test_deepseek_round_trip(b):
    assert json.dumps(DEEPSEEK.render_request(DEEPSEEK.parse_request(b))) == json.dumps(b)


@FAST
@given(body(("reasoning_content", "reasoning")))
def test_openai_chat_round_trip(b):
    assert json.dumps(CHAT.render_request(CHAT.parse_request(b))) == json.dumps(b)


@FAST
@given(body(("reasoning_content",)), st.booleans(), st.booleans())
def test_strip_is_pure_and_never_breaks_an_accepted_body(b, keep_tool_turns, rewrite_nudge):
    b["thinking"] = {"type": "enabled"}
    snapshot = copy.deepcopy(b)
    request = DEEPSEEK.parse_request(b)
    result = DEEPSEEK.strip(request, StripOptions(keep_tool_turns=keep_tool_turns, rewrite_nudge=rewrite_nudge))
    out = DEEPSEEK.render_request(result.request)
    assert b == snapshot and DEEPSEEK.render_request(request) == snapshot
    if DEEPSEEK.validate(snapshot) is None:
        assert DEEPSEEK.validate(out) is None
    for i in result.stripped_indexes:
        assert "reasoning_content" not in out["messages"][i]
        assert out["messages"][i] == {k: v for k, v in snapshot["messages"][i].items() if k != "reasoning_content"}
    # stripping twice strips nothing more
    again = DEEPSEEK.strip(result.request, StripOptions(keep_tool_turns=keep_tool_turns, rewrite_nudge=rewrite_nudge))
    assert again.request == result.request and again.stripped_indexes == ()
