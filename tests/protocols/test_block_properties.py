"""Property tests for the block and item protocols: any sequence of Anthropic
blocks or Responses items round-trips byte for byte, and strip() never
changes its input nor turns an accepted body into a refused one."""

from __future__ import annotations

import copy
import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from session_runtime.protocols import StripOptions, get_protocol

ANTHROPIC = get_protocol("anthropic")
RESPONSES = get_protocol("openai-responses")
FAST = settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
text = st.text(max_size=6)
ident = st.integers(0, 9).map(str)

thinking = st.builds(lambda t, s: {"type": "thinking", "thinking": t, "signature": s}, text, text)
redacted = st.builds(lambda d: {"type": "redacted_thinking", "data": d}, text)
tool_use = st.builds(lambda i, v: {"type": "tool_use", "id": f"toolu_{i}", "name": "f", "input": {"v": v}}, ident, text)
text_block = st.builds(lambda t: {"type": "text", "text": t}, text)
assistant = st.builds(lambda blocks: {"role": "assistant", "content": blocks},
                      st.lists(thinking | redacted | tool_use | text_block, min_size=1, max_size=5)) | st.builds(
    lambda t: {"role": "assistant", "content": t}, text)
user = st.builds(lambda t: {"role": "user", "content": t}, text) | st.builds(
    lambda i: {"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"toolu_{i}", "content": "r"}]}, ident)


@FAST
@given(st.lists(st.tuples(user, assistant), max_size=4), st.booleans(), st.sampled_from([None, "all_turns"]),
       st.sampled_from([{"type": "enabled", "budget_tokens": 1024}, {"type": "disabled"}]))
def test_anthropic(pairs, tail_user, context, thinking_config):
    messages = [m for pair in pairs for m in pair] + ([{"role": "user", "content": "go"}] if tail_user else [])
    body = {"model": "claude", "max_tokens": 64, "thinking": thinking_config, "messages": messages}
    snapshot = json.dumps(body)
    req = ANTHROPIC.parse_request(body)
    assert json.dumps(ANTHROPIC.render_request(req)) == snapshot
    out = ANTHROPIC.render_request(ANTHROPIC.strip(req, StripOptions(context=context)).request)
    assert json.dumps(body) == snapshot
    if ANTHROPIC.validate(body) is None:
        assert ANTHROPIC.validate(out) is None


reasoning_item = st.builds(lambda i, enc: {"type": "reasoning", "id": f"rs_{i}", "summary": [],
                                           **({"encrypted_content": "gAAA" + i} if enc else {})}, ident, st.booleans())
call_item = st.builds(lambda i, with_id: {"type": "function_call", **({"id": f"fc_{i}"} if with_id else {}),
                                          "call_id": f"call_{i}", "name": "f", "arguments": "{}"}, ident, st.booleans())
message_item = st.builds(lambda i, t: {"type": "message", "id": f"msg_{i}", "role": "assistant", "status": "completed",
                                       "content": [{"type": "output_text", "text": t, "annotations": []}]}, ident, text)
output_item = st.builds(lambda i: {"type": "function_call_output", "call_id": f"call_{i}", "output": "1"}, ident)
user_item = st.builds(lambda t: {"role": "user", "content": t}, text)


@FAST
@given(st.lists(reasoning_item | call_item | message_item | output_item | user_item, max_size=10), st.booleans(),
       st.sampled_from([None, "all_turns"]))
def test_responses(items, store, context):
    body = {"model": "gpt-5", "store": store, "input": items}
    snapshot = json.dumps(body)
    req = RESPONSES.parse_request(copy.deepcopy(body))
    assert json.dumps(RESPONSES.render_request(req)) == snapshot
    result = RESPONSES.strip(req, StripOptions(context=context))
    out = RESPONSES.render_request(result.request)
    assert RESPONSES.render_request(req) == body
    if RESPONSES.validate(body) is None:
        assert RESPONSES.validate(out) is None
