"""The upstream proxy's pure parts, no HTTP: a conversation's trace as each
protocol's request body (proxy/transcript.py), a provider's answer as what the
trace records, and the one outbound stripper (proxy/outbound.py) over a fake
client."""

from __future__ import annotations

import copy
import json
from types import SimpleNamespace

import pytest

from session_runtime.config import UPSTREAM_PROTOCOLS as NAMES  # the protocols the upstream proxy speaks
from session_runtime.protocols import StripOptions, get_protocol
from session_runtime.proxy.outbound import Outbound
from session_runtime.proxy.transcript import reply_parts, request_body
from session_runtime.templates.base import Message, ToolCall

TOOLS = [{"type": "function", "function": {"name": "calc", "description": "evaluate",
                                           "parameters": {"type": "object", "properties": {"e": {"type": "string"}}}}}]
PARAMS = {"model": "m", "max_tokens": 8, "temperature": 0.0}

# A provider's answer per protocol: reasoning, text and two tool calls.
ANSWERS = {
    "deepseek": {"id": "a", "object": "chat.completion", "model": "m", "choices": [{"index": 0, "message": {
        "role": "assistant", "content": None, "reasoning_content": "need calc", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "calc", "arguments": "{\"e\":\"1\"}"}},
            {"id": "call_2", "type": "function", "function": {"name": "calc", "arguments": "{\"e\":\"2\"}"}}]},
        "finish_reason": "tool_calls"}], "usage": {"prompt_tokens": 3, "completion_tokens": 4}},
    "anthropic": {"id": "msg_1", "type": "message", "role": "assistant", "model": "c", "content": [
        {"type": "thinking", "thinking": "need calc", "signature": "S1"},
        {"type": "text", "text": "let me see"},
        {"type": "tool_use", "id": "call_1", "name": "calc", "input": {"e": "1"}},
        {"type": "thinking", "thinking": "and again", "signature": "S2"},
        {"type": "tool_use", "id": "call_2", "name": "calc", "input": {"e": "2"}}],
        "stop_reason": "tool_use", "usage": {"input_tokens": 3, "output_tokens": 4}},
    "openai-responses": {"id": "resp_1", "object": "response", "model": "g", "status": "completed", "output": [
        {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "need calc"}],
         "encrypted_content": "gAAAA1"},
        {"type": "message", "id": "msg_1", "role": "assistant", "status": "completed",
         "content": [{"type": "output_text", "text": "let me see", "annotations": []}]},
        {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "calc", "arguments": "{\"e\":\"1\"}",
         "status": "completed"},
        {"type": "reasoning", "id": "rs_2", "summary": [{"type": "summary_text", "text": "and again"}],
         "encrypted_content": "gAAAA2"},
        {"type": "function_call", "id": "fc_2", "call_id": "call_2", "name": "calc", "arguments": "{\"e\":\"2\"}",
         "status": "completed"}],
        "usage": {"input_tokens": 3, "output_tokens": 4}},
}
ANSWERS["openai-chat"] = ANSWERS["deepseek"]
ANSWERS["gemini"] = {"candidates": [{"content": {"role": "model", "parts": [
    {"text": "need calc", "thought": True},
    {"text": "let me see"},
    {"functionCall": {"id": "call_1", "name": "calc", "args": {"e": "1"}}, "thoughtSignature": "S1"},
    {"text": "and again", "thought": True},
    {"functionCall": {"id": "call_2", "name": "calc", "args": {"e": "2"}}}]}, "finishReason": "STOP", "index": 0}],
    "usageMetadata": {"promptTokenCount": 3, "candidatesTokenCount": 4, "totalTokenCount": 7}}


def local_history() -> list[Message]:
    """A history no provider wrote (no wire): two turns, tool calls in both."""
    return [
        Message("user", 0, "hi"),
        Message("assistant", 0, "", reasoning="think 1", tool_calls=(ToolCall("c1", "calc", {"e": "1"}),)),
        Message("tool", 0, "2", tool_call_id="c1"),
        Message("assistant", 0, "done", reasoning="think 2"),
        Message("user", 1, "again"),
        Message("assistant", 1, "", reasoning="think 3",
                tool_calls=(ToolCall("c2", "calc", {"e": "2"}), ToolCall("c3", "calc", {"e": "3"}))),
        Message("tool", 1, "x", tool_call_id="c2"),
        Message("tool", 1, "y", tool_call_id="c3"),
    ]


def answered(protocol: str) -> tuple[list[Message], object]:
    """A history whose middle assistant message is the provider's answer
    (kept verbatim as its wire), then its results, a reply and a new question."""
    body = ANSWERS[protocol]
    parts = reply_parts(protocol, body, get_protocol(protocol).parse_response(body))
    message = Message("assistant", 0, parts.content, parts.reasoning, parts.calls, wire=parts.wire)
    results = [Message("tool", 0, f"r{c.id}", tool_call_id=c.id) for c in parts.calls]
    return [Message("user", 0, "q"), message, *results, Message("assistant", 0, "ok", reasoning="fin"),
            Message("user", 1, "q2")], parts


def outbound(protocol: str, **options) -> Outbound:
    client = SimpleNamespace(protocol=protocol)  # prepare never posts
    return Outbound(client, lambda text: len(text.split()), StripOptions(**options))


# ----- transcript.py: bodies the adapters read --------------------------------------------------


@pytest.mark.parametrize("protocol", NAMES)
def test_a_local_history_is_a_body_its_protocol_reads_back_and_accepts(protocol):
    body = request_body(protocol, "be brief", TOOLS, local_history(), PARAMS)
    adapter = get_protocol(protocol)
    assert adapter.render_request(adapter.parse_request(body)) == body
    assert adapter.validate(body) is None


def test_responses_tools_keep_chats_non_strict_default():
    """Responses makes a function tool strict (its schema normalized: every
    property required) unless `strict` says otherwise; a chat tool is not
    strict unless it says so."""
    strict = {"type": "function", "function": {"name": "exact", "parameters": {"type": "object"}, "strict": True}}
    body = request_body("openai-responses", None, [*TOOLS, strict], local_history(), PARAMS)
    assert [(t["name"], t["strict"]) for t in body["tools"]] == [("calc", False), ("exact", True)]
    assert body["tools"][0] == {"type": "function", "name": "calc", "description": "evaluate",
                                "parameters": TOOLS[0]["function"]["parameters"], "strict": False}


@pytest.mark.parametrize("protocol", NAMES)
def test_the_providers_answer_goes_back_verbatim_in_the_next_body(protocol):
    history, parts = answered(protocol)
    body = request_body(protocol, "be brief", TOOLS, history, PARAMS)
    adapter = get_protocol(protocol)
    assert adapter.render_request(adapter.parse_request(body)) == body
    assert adapter.validate(body) is None
    wire = json.loads(parts.wire)["message"]
    answer = ANSWERS[protocol]
    if protocol in ("deepseek", "openai-chat"):
        assert body["messages"][2] == answer["choices"][0]["message"]  # content null, reasoning, call ids
        assert body["messages"][2]["content"] is None
    elif protocol == "anthropic":
        assert body["messages"][1] == {"role": "assistant", "content": answer["content"]} == wire
        assert [b["type"] for b in body["messages"][2]["content"]] == ["tool_result", "tool_result"]
    elif protocol == "gemini":
        assert body["contents"][1] == answer["candidates"][0]["content"] == wire  # thoughts and signatures
        assert [p["functionResponse"]["id"] for p in body["contents"][2]["parts"]] == ["call_1", "call_2"]
        assert "model" not in body["generationConfig"] and body["generationConfig"]["maxOutputTokens"] == 8
    else:
        assert body["input"][1:6] == answer["output"] == wire  # every output item, in order
        assert body["store"] is False and body["include"] == ["reasoning.encrypted_content"]


def test_reply_parts_of_each_protocols_answer():
    for protocol in NAMES:
        body = ANSWERS[protocol]
        parts = reply_parts(protocol, body, get_protocol(protocol).parse_response(body))
        assert [(c.id, c.arguments) for c in parts.calls] == [("call_1", {"e": "1"}), ("call_2", {"e": "2"})]
        assert parts.finish_reason == "stop"
        if protocol in ("deepseek", "openai-chat"):
            assert (parts.reasoning, parts.content) == ("need calc", "")
        else:  # several reasoning blocks or items, the text between the calls
            assert (parts.reasoning, parts.content) == ("need calc\n\nand again", "let me see")


# ----- outbound.py: the stripper over a fake client -------------------------------------------


@pytest.mark.parametrize("protocol", NAMES)
def test_prepare_strips_earlier_turns_and_leaves_the_clients_body_alone(protocol):
    history, _ = answered(protocol)
    body = request_body(protocol, "be brief", TOOLS, history, PARAMS)
    before = copy.deepcopy(body)
    sent, account = outbound(protocol).prepare(body)
    assert body == before
    # chat sends the local reply's reasoning too; the others cannot (no signature, no encrypted item)
    assert account.mode == "lenient"
    assert account.messages_stripped == (2 if protocol in ("deepseek", "openai-chat") else 1)
    assert account.stripped_tokens > 0 and account.sent_reasoning_tokens == 0
    assert "need calc" not in json.dumps(sent) and "need calc" in json.dumps(body)
    sent_again, _ = outbound(protocol, passthrough=True).prepare(body)
    assert sent_again == body == before


def test_content_null_goes_out_as_null():
    history, _ = answered("deepseek")
    body = request_body("deepseek", None, [], history, PARAMS)
    sent, _ = outbound("deepseek").prepare(body)
    assert sent["messages"][1] == {"role": "assistant", "content": None,
                                   "tool_calls": ANSWERS["deepseek"]["choices"][0]["message"]["tool_calls"]}


def test_responses_requests_own_reasoning_context_keeps_every_turn():
    history, _ = answered("openai-responses")
    params = {**PARAMS, "reasoning": {"effort": "high", "context": "all_turns"}}
    body = request_body("openai-responses", None, [], history, params)
    sent, account = outbound("openai-responses").prepare(body)
    assert sent == body and account.messages_stripped == 0
    sent, account = outbound("openai-responses", context="all_turns").prepare(
        request_body("openai-responses", None, [], history, PARAMS))
    assert account.messages_stripped == 0 and "gAAAA1" in json.dumps(sent)


def test_an_empty_anthropic_answer_is_left_out_of_the_next_body():
    """Claude may answer tool results with no content at all (end_turn);
    Anthropic refuses a request holding an empty non-final message, so it is
    left out and the results and the next question make one user turn."""
    empty = {"id": "msg_2", "type": "message", "role": "assistant", "model": "c", "content": [],
             "stop_reason": "end_turn", "usage": {"input_tokens": 3, "output_tokens": 1}}
    parts = reply_parts("anthropic", empty, get_protocol("anthropic").parse_response(empty))
    history = [Message("user", 0, "q"), Message("assistant", 0, "", tool_calls=(ToolCall("c1", "calc", {}),)),
               Message("tool", 0, "2", tool_call_id="c1"), Message("assistant", 0, parts.content, wire=parts.wire),
               Message("user", 1, "and?"), Message("assistant", 1, ""), Message("user", 2, "well?")]
    body = request_body("anthropic", None, [], history, PARAMS)
    assert [m["role"] for m in body["messages"]] == ["user", "assistant", "user", "user", "user"]
    assert all(m["content"] for m in body["messages"])


def test_anthropic_thinking_goes_out_without_the_sampling_it_refuses():
    """With thinking on, Anthropic refuses a temperature other than 1 and a
    top_p below 0.95 (the runtime's default is greedy, temperature 0)."""
    thinking = {"type": "enabled", "budget_tokens": 1024}
    for sampling, kept in (({"temperature": 0.0, "top_p": 0.5}, {}), ({"temperature": 1, "top_p": 0.95},
                                                                       {"temperature": 1, "top_p": 0.95})):
        body = request_body("anthropic", None, [], local_history(), {**PARAMS, **sampling, "thinking": thinking})
        assert {k: body[k] for k in ("temperature", "top_p") if k in body} == kept
    body = request_body("anthropic", None, [], local_history(), {**PARAMS, "top_p": 0.5})
    assert (body["temperature"], body["top_p"]) == (0.0, 0.5)  # thinking off: as asked


# ----- client.py and the streamed relay --------------------------------------------------------


def test_a_gzipped_stream_is_relayed_decoded():
    """The relay sends no Content-Encoding, so what it relays must be plain
    (httpx asks for gzip on its own)."""
    import gzip

    import httpx

    from session_runtime.proxy.client import UpstreamClient

    sse = b'data: {"choices":[{"delta":{"content":"hi"}}]}\n\ndata: [DONE]\n\n'
    client = UpstreamClient("http://upstream.invalid/v1", "deepseek", key="k")
    client._http = httpx.Client(transport=httpx.MockTransport(lambda request: httpx.Response(
        200, content=gzip.compress(sse), headers={"content-encoding": "gzip", "content-type": "text/event-stream"})))
    with client.stream({"model": "m", "messages": [], "stream": True}) as (status, chunks):
        assert (status, b"".join(chunks)) == (200, sse)
    client.close()


def test_a_streamed_5xx_is_unavailable_as_a_plain_ones_is():
    import contextlib

    from session_runtime.backends.upstream.backend import UpstreamBackend
    from session_runtime.errors import UpstreamError, UpstreamUnavailable

    config = SimpleNamespace(page_size=16, max_context=4096, upstream_url="http://upstream.invalid/v1",
                             upstream_protocol="deepseek", upstream_key="k", upstream_timeout_s=5.0,
                             reasoning_passthrough=False, keep_tool_turn_reasoning=False, upstream_model=None,
                             upstream_reasoning_context=None)
    backend = UpstreamBackend(config, SimpleNamespace(count=lambda text: len(text.split())))
    body = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    for status, raised in ((503, UpstreamUnavailable), (400, UpstreamError)):
        backend.client.stream = contextlib.contextmanager(
            lambda sent: iter([(status, iter([b'{"error":{"message":"no"}}']))]))
        with pytest.raises(raised) as e:
            backend.forward_stream(body)
        assert e.value.details["status"] == status and e.value.details["body"] == {"error": {"message": "no"}}
    backend.close()


def test_the_clients_post_names_an_unreachable_and_a_slow_upstream():
    """A step's POST (over direct_http): nothing listening is 'cannot be reached'
    (502), no answer within the timeout is 504; a gzipped answer is read plain."""
    import gzip
    import http.server
    import socket
    import threading
    import time

    from session_runtime.errors import UpstreamUnavailable
    from session_runtime.proxy.client import UpstreamClient

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(UpstreamUnavailable, match="cannot be reached") as e:
        UpstreamClient(f"http://127.0.0.1:{port}/v1", "deepseek", key="k").post({"model": "m"})
    assert e.value.status == 502

    class Slow(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):
            pass

        def do_POST(self):
            self.rfile.read(int(self.headers["content-length"]))
            if self.path.endswith("/slow/chat/completions"):
                time.sleep(2)
            body = gzip.compress(b'{"ok": true}')
            self.send_response(200)
            self.send_header("content-encoding", "gzip")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Slow)
    srv.daemon_threads = True
    srv.handle_error = lambda request, address: None  # the slow answer's client is gone: a broken pipe, expected
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        base = f"http://127.0.0.1:{srv.server_address[1]}"
        with pytest.raises(UpstreamUnavailable, match="did not answer in time") as e:
            UpstreamClient(base + "/slow", "deepseek", key="k", timeout_s=0.5).post({"model": "m"})
        assert e.value.status == 504
        assert UpstreamClient(base + "/fast", "deepseek", key="k").post({"model": "m"}).body == {"ok": True}
    finally:
        srv.shutdown()
        srv.server_close()
