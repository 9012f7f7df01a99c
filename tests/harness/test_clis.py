"""Claude Code, Codex CLI and Gemini CLI, unchanged, against the server: each
runs a first turn and continues it (`claude -p` then `claude -p --continue`;
`codex exec` then `codex exec resume --last`; `gemini -p` then `gemini
--resume latest -p`), on the embedded engine and on SGLang's
server. Every request is answered 200, the CLI reports no error, the
stateless requests become one inferred conversation holding both turns, and
the second turn's requests come at least 90% from the cache.

The model is tests/harness/answering_model.py's: a real Qwen3 folder whose
answers end ("Hello"), so the CLIs take them as answers and send them back
(random weights never end a turn: every answer would end on the output cap,
an error to both CLIs, which then never echo the answer). The CLIs run as
shipped: Claude Code's ~24 tools and system prompt (about 27k tokens a
request), Codex's instructions and tools, no output cap from Codex (the
server gives what remains of the context).

One SGLang server for this module (about 70 CPU-seconds to start), serving
the answering folder.
"""

from __future__ import annotations

import logging
import re

import httpx
import pytest

from tests.api.conftest import start_server
from tests.conftest import TINY_SHAPE
from tests.harness.answering_model import save_answering_model
from tests.harness.clis import ClaudeCode, Codex, GeminiCLI, cached_share, claude_ok, codex_ok, inferred

NAMES = ("claude-sonnet-4-5", "claude-haiku-4-5-20251001", "gpt-5-codex", "gemini-2.5-pro")
CONTEXT = 40960  # Claude Code's first request is about 27k tokens


@pytest.fixture(scope="module")
def answering_folder(tmp_path_factory):
    from session_runtime.tokenizer import load_tokenizer

    return save_answering_model(tmp_path_factory.mktemp("answering"), {**TINY_SHAPE, "max_position_embeddings": CONTEXT},
                                load_tokenizer("tiny"))


@pytest.fixture(scope="module", params=["embedded", "sglang"])
def server(request, answering_folder):
    """The runtime on `backend` over the answering folder, served on loopback, and a client of it."""
    from session_runtime.config import RuntimeConfig
    from session_runtime.runtime import Runtime

    rt = Runtime(RuntimeConfig(model=str(answering_folder), backend=request.param, template="deepseek",
                               page_size=16, pool_tokens=65536, data_dir=None, served_model_names=NAMES),
                 background=False)
    live = start_server(rt)
    try:
        with httpx.Client(base_url=live.url, timeout=120) as client:
            yield live, client
    finally:
        live.stop()
        rt.close()


@pytest.fixture
def statuses(caplog):
    """The status of every request the server answers during the test."""
    caplog.set_level(logging.INFO, logger="session_runtime.access")

    def read(path: str) -> list[int]:
        out = []
        for rec in caplog.records:
            m = re.match(r"\w+ (\S+) (\d+) ", rec.getMessage()) if rec.name == "session_runtime.access" else None
            if m and m.group(1) == path:
                out.append(int(m.group(2)))
        return out

    return read


def _one_conversation(client: httpx.Client, protocol: str) -> dict:
    """The one conversation inferred from `protocol`'s requests: both turns, the second from cache."""
    found = inferred(client, protocol)
    assert len(found) == 1, [(c["id"], len(c["turns"])) for c in found]
    conv = found[0]
    assert len(conv["turns"]) == 2 and all(t["steps"] for t in conv["turns"]), conv["turns"]
    assert cached_share(conv["turns"][1]) >= 0.9, conv["turns"][1]["steps"]
    assert [e["content"] for e in conv["trace"] if e["role"] == "assistant"] == ["Hello", "Hello"]
    return conv


def test_claude_code(server, statuses, tmp_path):
    live, client = server
    cli = ClaudeCode(live.url, "claude-sonnet-4-5", tmp_path)
    first = cli.ask("Say hello")
    assert claude_ok(first) and first["result"] == "Hello", first
    second = cli.ask("And again", resume=True)
    assert claude_ok(second) and second["result"] == "Hello", second
    assert second["session_id"] == first["session_id"]
    seen = statuses("/v1/messages")
    assert seen and set(seen) == {200}, seen
    conv = _one_conversation(client, "anthropic")
    assert conv["turns"][0]["steps"][0]["prompt_tokens"] > 10_000  # the shipped tools and system prompt
    # The CLI's usage (message_start's input figures) says the same: the second turn read its prompt from cache.
    usage = second["usage"]
    assert usage["cache_read_input_tokens"] >= 9 * usage["input_tokens"], usage
    client.delete(f"/v1/conversations/{conv['id']}")


def test_codex(server, statuses, tmp_path):
    live, client = server
    cli = Codex(live.url, "gpt-5-codex", tmp_path)
    first = cli.ask("Say hello")
    assert codex_ok(first) and "Hello" in first.stdout, first.stderr[-3000:]
    second = cli.ask("And again", resume=True)
    assert codex_ok(second) and "Hello" in second.stdout, second.stderr[-3000:]
    seen = statuses("/v1/responses")
    assert len(seen) >= 2 and set(seen) == {200}, seen
    conv = _one_conversation(client, "openai-responses")
    client.delete(f"/v1/conversations/{conv['id']}")


def test_gemini_cli(server, statuses, tmp_path):
    live, client = server
    cli = GeminiCLI(live.url, "gemini-2.5-pro", tmp_path)
    first = cli.ask("Say hello")
    assert first.get("response") == "Hello" and not first.get("error"), first
    second = cli.ask("And again", resume=True)
    assert second.get("response") == "Hello" and not second.get("error"), second
    seen = statuses("/v1beta/models/gemini-2.5-pro:streamGenerateContent")
    assert len(seen) >= 2 and set(seen) == {200}, seen
    conv = _one_conversation(client, "gemini")
    assert conv["turns"][0]["steps"][0]["prompt_tokens"] > 5_000  # the CLI's own tools and system prompt
    client.delete(f"/v1/conversations/{conv['id']}")
