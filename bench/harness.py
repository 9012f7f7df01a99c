"""Stateless agent traffic (the way Claude Code talks: the whole history in every
request, no conversation id) on ONE SGLang server, three arms side by side.

    .venv/bin/python bench/harness.py [--quick] [--sessions 2] [--turns 5] [--long-turns 300] [--long-budget-s 300]
                                      [--name harness]

Writes bench/results/NAME.json and NAME.png. One SGLang 0.5.23 server (CPU),
started here with the `session` radix-cache backend *and* its tokenizer (so
that its own Anthropic route /v1/messages works), `--enable-cache-report`, and
the runtime (`session-runtime serve --backend sglang --sglang-url` that server)
in its own process. Arms, the same Anthropic Messages client for all three:

- `sglang`: SGLang's own /v1/messages on the server directly (its radix cache
  the only reuse; its chat template decides what earlier turns' thinking becomes);
- `runtime_drop`: the runtime's /v1/messages, stateless, with
  `context_management: clear_thinking_20251015, keep thinking_turns 1`;
- `runtime_keep`: the same with `keep: "all"`.

The model: random weights cannot call a tool, and a stateless client must send
back what the server generated (thinking with its signature, text, tool_use),
so the model folder is built here by hand, like tests/harness/answering_model.py:
a Qwen3-shaped model (4 layers, hidden 256, Qwen3's tokenizer) whose layers add
nothing, so that the next token depends only on the current one, and whose
embeddings and head spell one fixed chain: a reasoning of ~100 distinct
tokens, `</think>`, a short answer, one `search` tool call, `<|im_end|>`. Its
chat template is Qwen3's official one with two changes that keep every token of
the chain distinct (a chain cannot repeat a token): the generation prompt ends
with `<think>\\n` (as Qwen3-Thinking-2507's does) and a tool call is written
without spaces or newlines. The runtime renders it with `--template hf` (the
folder's own template), SGLang with the same Jinja text, so both render the
same tokens. A tool step asks for the whole chain (it ends with the call); a
turn's last step asks for fewer tokens (`max_tokens` cut right after the
answer's text), so it ends without a call and the next request is a new user
message. Output is generated (temperature 0), never forced.

Sessions are synthetic in the shape of the shipped traces (examples/traces):
a system prompt with tools, per turn a user message, 1-3 tool steps with
results of 40-160 tokens, and a final answer. Every (session, arm) gets its own
system prompt, so no arm reuses another's cache. The arms run round robin,
one request at a time (the order rotates every round), so machine noise lands
on all alike.

Measured per arm: request-path prefill (uncached prompt tokens from each
answer's usage: input_tokens; SGLang's comes from --enable-cache-report),
TTFT (client: request sent -> first content_block_delta, streamed) p50/p99, and
at the end KV held per session (runtime: GET /v1/conversations/{id}'s chain;
SGLang holds nothing per session: its figure is the tokens the session's
requests inserted, all evictable). Then one long stateless session on the
runtime (drop) measures the runtime process's CPU per request at turn ~10 and
turn ~N (psutil, all its threads).
"""

from __future__ import annotations

import time as _time

_T0 = _time.perf_counter()

import argparse  # noqa: E402
import contextlib  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import platform  # noqa: E402
import random  # noqa: E402
import signal  # noqa: E402
import socket  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path[:] = [p for p in sys.path if Path(p or os.getcwd()).resolve() != ROOT / "bench"] + [str(ROOT / "bench")]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402
import psutil  # noqa: E402

from report import RESULTS, write_report  # noqa: E402

ARMS = ("sglang", "runtime_drop", "runtime_keep")
MODEL_NAME = "harness-tiny"
WORDS = ("alpha beta gamma delta epsilon search file result check value plan step code test data model cache "
         "token query answer error path read write list node tree page time build patch diff branch merge "
         "config module class function import return string number array object field table index "
         "server client request response header body status route handler worker queue thread lock").split()
TOOLS = [{"name": "search", "description": "Search the workspace for a pattern",
          "input_schema": {"type": "object", "properties": {"query": {"type": "string"}}}},
         {"name": "read_file", "description": "Read a file of the workspace",
          "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}},
         {"name": "run_tests", "description": "Run the test suite",
          "input_schema": {"type": "object", "properties": {}}}]

# ----- the model folder --------------------------------------------------------------

# Qwen3's official chat template (tests/data/qwen3_chat_template.jinja) with two
# changes: the generation prompt ends with "<think>\n" and a call is written
# `<tool_call>{"name":"N","arguments":{...}}</tool_call>` (no spaces, no newlines).
TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>{\"name\":<function-name>,\"arguments\":<args-json-object>}</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set content = message.content %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is defined and message.reasoning_content is not none %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in message.content %}
                {%- set content = message.content.split('</think>')[-1].lstrip('\n') %}
                {%- set reasoning_content = message.content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>{"name":"' }}
                {{- tool_call.name }}
                {{- '","arguments":' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n<think>\n' }}
{%- endif %}
"""

REASONING = (
    "I should look at the repository layout before editing anything so a quick scan comes first and then "
    "we decide which module deserves opening. Our failing behaviour probably lives near where requests get parsed, "
    "maybe its tokenizer path or some cached prefix handling differs between branches: checking every caller "
    "would cost minutes hence one targeted grep over source files seems wiser; after that result arrives "
    "my plan is reading whichever function matches plus comparing it against recent commits while writing down "
    "hypotheses for verifying individually with small experiments until everything agrees!"
)
ANSWER = "Let me search our workspace now!"
CALL = '<tool_call>{"name":"search","arguments":{}}</tool_call>'


def qwen_tokenizer():
    from session_runtime.tokenizer import qwen3_tokenizer

    return qwen3_tokenizer()


def output_chain(tok) -> tuple[list[int], int]:
    """The model's output ids (distinct) and how many of them end the answer's text."""
    ids = tok.encode(REASONING + "\n</think>\n\n" + ANSWER + CALL + "<|im_end|>")
    dup = {tok.decode([i]) for i in ids if ids.count(i) > 1 or i in tok.encode("\n")}
    assert not dup, f"the chain repeats tokens {dup}: edit REASONING/ANSWER"
    answer_end = len(tok.encode(REASONING + "\n</think>\n\n" + ANSWER))
    assert ids[:answer_end] == tok.encode(REASONING + "\n</think>\n\n" + ANSWER)
    return ids, answer_end


def build_folder(root: Path) -> tuple[Path, dict]:
    """The scripted model folder (built once per content, under `root`)."""
    import hashlib

    tok = qwen_tokenizer()
    ids, answer_end = output_chain(tok)
    key = hashlib.sha256((TEMPLATE + REASONING + ANSWER + CALL).encode()).hexdigest()[:10]
    folder = root / f"scripted-qwen3-{key}"
    info = {"output_tokens_tool_step": len(ids), "output_tokens_answer_step": answer_end,
            "reasoning_tokens": len(tok.encode(REASONING)), "folder": str(folder)}
    if (folder / "model.safetensors").exists():
        return folder, info
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from tests.harness.answering_model import make_state_machine

    nl = tok.encode("\n")
    assert len(nl) == 1
    seq = nl + ids  # the generation prompt's last token ("\n" after <think>) starts the chain
    hidden = 256
    assert len(seq) + 1 <= hidden, "one embedding direction per chain token"
    im_end = tok.token_id("<|im_end|>")
    cfg = Qwen3Config(vocab_size=151936, hidden_size=hidden, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=64, intermediate_size=512, rope_theta=1e6, rms_norm_eps=1e-6,
                      max_position_embeddings=32768, tie_word_embeddings=False, eos_token_id=im_end)
    model = Qwen3ForCausalLM(cfg).eval()
    make_state_machine(model, {seq[k]: seq[k + 1] for k in range(len(seq) - 1)}, otherwise=im_end)
    tmp = Path(tempfile.mkdtemp(prefix=".scripted-", dir=root))
    model.save_pretrained(tmp, safe_serialization=True)
    (tmp / "tokenizer.json").write_bytes((Path.home() / ".cache/session-runtime/qwen3-tokenizer-nfc.json").read_bytes())
    (tmp / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 32768, "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>", "bos_token": None, "add_bos_token": False, "add_eos_token": False,
        "clean_up_tokenization_spaces": False, "chat_template": TEMPLATE}, indent=1))
    (tmp / "generation_config.json").write_text(json.dumps({"eos_token_id": [im_end, tok.token_id("<|endoftext|>")]}))
    try:
        tmp.rename(folder)
    except OSError:  # another run wrote it first
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return folder, info


# ----- processes ---------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen, log: Path, timeout_s: float = 600) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: the process exited ({proc.returncode}); log {log}:\n"
                               + "\n".join(log.read_text(errors="replace").splitlines()[-30:]))
        try:
            if httpx.get(url + "/health", timeout=3).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError(f"{url} did not answer /health in {timeout_s} s; log {log}")


class Group:
    """A child process in its own process group, stopped (the whole group) on close."""

    def __init__(self, argv: list[str], log: Path, env: dict):
        self.log = log
        self.proc = subprocess.Popen(argv, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                                     start_new_session=True)

    def close(self) -> None:
        for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                return
            deadline = time.time() + wait
            while time.time() < deadline:
                if self.proc.poll() is not None:
                    try:
                        os.killpg(self.proc.pid, 0)
                    except ProcessLookupError:
                        return
                time.sleep(0.1)


def start_sglang(args, folder: Path, workdir: Path) -> tuple[Group, str]:
    from radix_ext.sglang.platform import ENV as CPU_PLATFORM_ENV

    port = free_port()
    argv = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(folder), "--host", "127.0.0.1",
            "--port", str(port), "--device", "cpu", "--dtype", "float32", "--page-size", str(args.page_size),
            "--max-total-tokens", str(args.pool_tokens), "--context-length", str(args.max_context),
            "--max-running-requests", "8", "--radix-cache-backend", "session", "--enable-priority-scheduling",
            "--sleep-on-idle", "--random-seed", "0", "--enable-cache-report", "--reasoning-parser", "qwen3",
            "--tool-call-parser", "hermes", "--served-model-name", MODEL_NAME]
    env = {**os.environ, CPU_PLATFORM_ENV: "1", "OMP_NUM_THREADS": str(args.threads)}
    return launch(argv, workdir / "sglang.log", env, port)


def start_runtime(args, folder: Path, sglang_url: str, workdir: Path) -> tuple[Group, str]:
    port = free_port()
    data = workdir / "runtime-data"
    data.mkdir()
    argv = [sys.executable, "-m", "session_runtime.cli", "serve", "--backend", "sglang", "--sglang-url", sglang_url,
            "--model", str(folder), "--template", "hf", "--page-size", str(args.page_size),
            "--pool-tokens", str(args.pool_tokens), "--max-context", str(args.max_context),
            "--served-model-name", MODEL_NAME, "--data-dir", str(data), "--port", str(port),
            "--max-conversations-per-tenant", "0", "--max-tenant-bytes", "0", "--no-access-log",
            "--offload", "never"]
    return launch(argv, workdir / "runtime.log", {**os.environ, "PYTHONPATH": str(ROOT)}, port)


def launch(argv: list[str], log: Path, env: dict, port: int) -> tuple[Group, str]:
    """Start a server's process group and wait until it answers on `port`."""
    g = Group(argv, log, env)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, g.proc, g.log)
    except BaseException:
        g.close()
        raise
    return g, url


# ----- the client --------------------------------------------------------------------


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


@dataclasses.dataclass
class Turn:
    user: str
    results: list[str]  # one tool result per tool step; the step after the last one answers


def make_session(rng: random.Random, turns: int, scale: float = 1.0) -> list[Turn]:
    size = lambda lo, hi: max(1, round(rng.randint(lo, hi) * scale))  # noqa: E731
    return [Turn("Next task: " + words(rng, size(10, 40)),
                 [words(rng, size(40, 160)) for _ in range(rng.randint(1, 3))]) for _ in range(turns)]


CONTEXT_MGMT = {
    "runtime_drop": {"edits": [{"type": "clear_thinking_20251015", "keep": {"type": "thinking_turns", "value": 1}}]},
    "runtime_keep": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
}


def sse(resp) -> "iter[tuple[str, dict]]":
    event = None
    for line in resp.iter_lines():
        if line.startswith("event:"):
            event = line[6:].strip()
        elif line.startswith("data:"):
            data = line[5:].strip()
            if data and data != "[DONE]":
                yield event, json.loads(data)


def send(http: httpx.Client, url: str, arm: str, system: str, messages: list, max_tokens: int,
         answer=ANSWER, stream: bool = True) -> dict:
    """One streamed /v1/messages request; returns the assistant message, usage, TTFT and the conversation."""
    body = {"model": MODEL_NAME, "max_tokens": max_tokens, "system": system, "tools": TOOLS, "messages": messages,
            "stream": stream, "temperature": 0.0, "thinking": {"type": "enabled", "budget_tokens": 1024}}
    if arm in CONTEXT_MGMT:
        body["context_management"] = CONTEXT_MGMT[arm]
    blocks: list[dict] = []
    usage: dict = {}
    stop = None
    t0 = time.perf_counter()
    first = None
    if not stream:
        resp = http.post(url + "/v1/messages", json=body, timeout=600)
        if resp.status_code >= 400:
            raise RuntimeError(f"{arm}: HTTP {resp.status_code}: {resp.text[:500]}")
        end = time.perf_counter()
        out = resp.json()
        return {"content": out["content"], "usage": out.get("usage") or {}, "stop": out.get("stop_reason"),
                "ttft_ms": None, "total_ms": (end - t0) * 1e3,
                "conversation": resp.headers.get("x-session-runtime-conversation"), "repaired": False}
    with http.stream("POST", url + "/v1/messages", json=body, timeout=600) as resp:
        if resp.status_code >= 400:
            raise RuntimeError(f"{arm}: HTTP {resp.status_code}: {resp.read()[:500]!r}")
        conv = resp.headers.get("x-session-runtime-conversation")
        for event, data in sse(resp):
            kind = data.get("type", event)
            if kind == "message_start":
                usage.update({k: v for k, v in (data["message"].get("usage") or {}).items() if v is not None})
            elif kind == "content_block_start":
                blocks.append(dict(data["content_block"]))
                if blocks[-1]["type"] == "tool_use":
                    blocks[-1]["_json"] = ""
            elif kind == "content_block_delta":
                if first is None:
                    first = time.perf_counter()
                d, b = data["delta"], blocks[data["index"]] if data["index"] < len(blocks) else blocks[-1]
                if d["type"] == "thinking_delta":
                    b["thinking"] = b.get("thinking", "") + d["thinking"]
                elif d["type"] == "signature_delta":
                    b["signature"] = d["signature"]
                elif d["type"] == "text_delta":
                    b["text"] = b.get("text", "") + d["text"]
                elif d["type"] == "input_json_delta":
                    b["_json"] += d["partial_json"]
            elif kind == "message_delta":
                usage.update({k: v for k, v in (data.get("usage") or {}).items() if v is not None})
                stop = (data.get("delta") or {}).get("stop_reason")
            elif kind == "error":
                raise RuntimeError(f"{arm}: stream error {data}")
    end = time.perf_counter()
    content = []
    for b in blocks:
        if b["type"] == "tool_use":
            raw = b.pop("_json")
            b["input"] = json.loads(raw) if raw.strip() else (b.get("input") or {})
        content.append(b)
    repaired = repair_stream(content, answer) if arm != "sglang" else False
    return {"content": content, "usage": usage, "stop": stop, "ttft_ms": ((first or end) - t0) * 1e3,
            "total_ms": (end - t0) * 1e3, "conversation": conv, "repaired": repaired}


def repair_stream(content: list, answer) -> bool:
    """The runtime's stream (this model, generation prompt ending in `<think>\\n`) sends the reasoning
    first as a text block, then a thinking block with the same text and its signature, and never the
    answer's text (its non-streamed answer is right). Echoed as streamed, that history matches no stored
    conversation, so every request would start a new one. Rebuild what the non-streamed answer says:
    drop the text copy of the reasoning and put the answer's text (known: the model is scripted) after
    the thinking block. Returns whether it had to."""
    thinking = [b for b in content if b["type"] == "thinking"]
    if not thinking:
        return False
    dup = [b for b in content if b["type"] == "text" and b.get("text", "").strip() == thinking[0].get("thinking", "").strip()]
    if not dup:
        return False
    for b in dup:
        content.remove(b)
    if answer and not any(b["type"] == "text" for b in content):
        content.insert(content.index(thinking[0]) + 1, {"type": "text", "text": answer})
    return True


class Session:
    """One agent session of one arm: the history a harness keeps and sends."""

    def __init__(self, arm: str, url: str, sid: int, turns: list[Turn], info: dict, rng: random.Random):
        self.arm, self.url, self.sid = arm, url, sid
        self.system = (f"Session {sid} of arm {arm}. You are a careful coding agent working in a repository. "
                       + words(rng, 250))
        self.turns, self.info = turns, info
        self.messages: list = []
        self.plan = [(t, k) for t in range(len(turns)) for k in range(len(turns[t].results) + 1)]
        self.pos = 0
        self.rows: list[dict] = []
        self.conversations: list[str] = []

    def done(self) -> bool:
        return self.pos >= len(self.plan)

    def step(self, http: httpx.Client) -> dict:
        t, k = self.plan[self.pos]
        turn = self.turns[t]
        if k == 0:
            self.messages.append({"role": "user", "content": turn.user})
        last = k == len(turn.results)
        max_tokens = self.info["output_tokens_answer_step"] if last else self.info["output_tokens_tool_step"] + 4
        r = send(http, self.url, self.arm, self.system, self.messages, max_tokens)
        kinds = [b["type"] for b in r["content"]]
        if last == ("tool_use" in kinds):
            raise RuntimeError(f"{self.arm} session {self.sid} turn {t} step {k}: output {kinds} "
                               f"(stop {r['stop']}): the scripted model did not answer as expected")
        self.messages.append({"role": "assistant", "content": r["content"]})
        if not last:
            call = next(b for b in r["content"] if b["type"] == "tool_use")
            self.messages.append({"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": call["id"], "content": turn.results[k]}]})
        u = r["usage"]
        cached = u.get("cache_read_input_tokens") or 0
        row = {"turn": t, "step": k, "prompt_tokens": u.get("input_tokens", 0) + cached
               + (u.get("cache_creation_input_tokens") or 0), "cached_tokens": cached,
               "prefill_tokens": u.get("input_tokens", 0), "output_tokens": u.get("output_tokens"),
               "ttft_ms": round(r["ttft_ms"], 2), "total_ms": round(r["total_ms"], 2), "stop": r["stop"],
               "stream_repaired": r["repaired"]}
        if r["conversation"]:
            row["conversation"] = r["conversation"]
            if r["conversation"] not in self.conversations:
                self.conversations.append(r["conversation"])
        self.rows.append(row)
        self.pos += 1
        return row


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    if not s:
        return float("nan")
    return s[max(0, min(len(s) - 1, int(round(q / 100 * len(s) + 0.5)) - 1))]


def arm_summary(sessions: list[Session], http: httpx.Client, runtime_url: str) -> dict:
    rows = [r for s in sessions for r in s.rows]
    ttft = [r["ttft_ms"] for r in rows]
    turn_first = [r["ttft_ms"] for r in rows if r["step"] == 0 and r["turn"] > 0]
    out = {
        "requests": len(rows),
        "prompt_tokens": sum(r["prompt_tokens"] for r in rows),
        "cached_tokens": sum(r["cached_tokens"] for r in rows),
        "prefill_tokens": sum(r["prefill_tokens"] for r in rows),
        "prefill_tokens_turn_starts": sum(r["prefill_tokens"] for r in rows if r["step"] == 0),
        "prefill_tokens_tool_steps": sum(r["prefill_tokens"] for r in rows if r["step"] > 0),
        "output_tokens": sum(r["output_tokens"] or 0 for r in rows),
        "streams_repaired": sum(bool(r.get("stream_repaired")) for r in rows),
        "ttft_ms_p50": round(pct(ttft, 50), 2), "ttft_ms_p99": round(pct(ttft, 99), 2),
        "ttft_ms_mean": round(statistics.mean(ttft), 2),
        "next_turn_ttft_ms_p50": round(pct(turn_first, 50), 2) if turn_first else None,
        "per_session": [],
    }
    for s in sessions:
        ps = {"session": s.sid, "requests": len(s.rows), "prefill_tokens": sum(r["prefill_tokens"] for r in s.rows),
              "conversations": s.conversations}
        if s.arm == "sglang":
            # SGLang locks nothing per session: what its requests left in the tree (prefill + output,
            # nothing evicted in a pool this size) is evictable cache, not held KV.
            ps["kv_tokens_inserted_evictable"] = sum(r["prefill_tokens"] + (r["output_tokens"] or 0) for r in s.rows)
        elif s.conversations:
            try:
                g = http.get(f"{runtime_url}/v1/conversations/{s.conversations[-1]}", timeout=60).json()
                ps["kv_tokens_held"] = g["chain"]["cached_tokens"]
                ps["chain_sequence_tokens"] = g["chain"]["sequence_tokens"]
                ps["chain_kind"] = g["chain"]["kind"]
                ps["idle_materialized_prefill_tokens"] = sum(
                    (t.get("materialized_prefill_tokens") or 0) for t in g.get("turns", []))
                ps["turns_seen"] = len(g.get("turns", []))
            except Exception as exc:  # noqa: BLE001
                ps["kv_tokens_held"] = None
                ps["error"] = repr(exc)
        out["per_session"].append(ps)
    if sessions and sessions[0].arm == "sglang":
        out["kv_tokens_per_session"] = statistics.mean(p["kv_tokens_inserted_evictable"] for p in out["per_session"])
        out["kv_note"] = "evictable tokens the session's requests inserted (SGLang holds no KV per session)"
    else:
        held = [p.get("kv_tokens_held") for p in out["per_session"] if p.get("kv_tokens_held") is not None]
        out["kv_tokens_per_session"] = statistics.mean(held) if held else None
        out["idle_materialized_prefill_tokens"] = sum(p.get("idle_materialized_prefill_tokens") or 0
                                                      for p in out["per_session"])
        out["distinct_conversations"] = sum(len(p["conversations"]) for p in out["per_session"])
    return out


def long_session(http: httpx.Client, url: str, proc: psutil.Process, turns: int, rng: random.Random,
                 max_tokens: int, budget_s: float) -> dict:
    """One stateless session of `turns` turns (user message, short answer) on the runtime, drop policy:
    the runtime process's CPU per request around turn 10 and at the last turn reached (the session
    stops early once it has run `budget_s` seconds: the runtime's time per request grows with it)."""
    start = time.perf_counter()
    system = "Long session. You are a careful coding agent. " + words(rng, 250)
    messages: list = []
    cpu, wall, ttft, conv, repaired = [], [], [], set(), 0
    for t in range(turns):
        messages.append({"role": "user", "content": "Next: " + words(rng, 20)})
        c0, w0 = proc.cpu_times(), time.perf_counter()
        r = send(http, url, "runtime_drop", system, messages, max_tokens, answer=None, stream=False)
        c1, w1 = proc.cpu_times(), time.perf_counter()
        messages.append({"role": "assistant", "content": r["content"]})
        conv.add(r["conversation"])
        repaired += bool(r["repaired"])
        cpu.append(round((c1.user + c1.system - c0.user - c0.system) * 1e3, 2))
        wall.append(round((w1 - w0) * 1e3, 2))
        if t % 50 == 0:
            print(f"[long] turn {t + 1}/{turns}: runtime cpu {cpu[-1]:.1f} ms, wall {wall[-1]:.0f} ms", flush=True)
        if t + 1 >= 30 and time.perf_counter() - start > budget_s:
            print(f"[long] stopped at turn {t + 1}: over the {budget_s:.0f} s budget", flush=True)
            break
    reached = len(cpu)
    windows = {"10": (5, 15), "long": (reached - 10, reached)}
    out = {"turns_asked": turns, "turns": reached, "stopped_by_budget": reached < turns, "budget_s": budget_s,
           "max_tokens": max_tokens, "distinct_conversations": len(conv), "streams_repaired": repaired,
           "cpu_ms_per_request": cpu, "wall_ms_per_request": wall, "windows": {}}
    for name, (a, b) in windows.items():
        sel = cpu[a - 1: b]
        out["windows"][name if name == "10" else str(reached)] = {"turns": [a, b], "cpu_ms_median": round(statistics.median(sel), 2),
                                "cpu_ms_mean": round(statistics.mean(sel), 2),
                                "wall_ms_median": round(statistics.median(wall[a - 1: b]), 2)}
    return out


# ----- the report ---------------------------------------------------------------------


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b, c) = plt.subplots(1, 3, figsize=(18, 5))
    arms = result["arms"]
    names = list(arms)
    colors = {"sglang": "tab:gray", "runtime_drop": "tab:blue", "runtime_keep": "tab:orange"}
    x = range(len(names))
    a.bar([i - 0.2 for i in x], [arms[n]["prefill_tokens_turn_starts"] for n in names], 0.4, label="turn starts")
    a.bar([i + 0.2 for i in x], [arms[n]["prefill_tokens_tool_steps"] for n in names], 0.4, label="tool steps")
    a.set_xticks(list(x), names)
    a.set(ylabel="request-path prefill tokens (all sessions)", title="uncached prompt tokens per arm")
    a.legend()
    for n in names:
        vals = sorted(r["ttft_ms"] for s in result["requests"][n] for r in s)
        b.plot(vals, [(i + 1) / len(vals) for i in range(len(vals))], label=n, color=colors.get(n))
    b.set(xlabel="TTFT ms (streamed, client side)", ylabel="CDF", title="time to first token", xscale="log")
    b.legend()
    ls = result.get("long_session")
    if ls:
        cpu = ls["cpu_ms_per_request"]
        c.plot(range(1, len(cpu) + 1), cpu, ".", ms=3, label="runtime CPU per request")
        for name, w in ls["windows"].items():
            c.plot(w["turns"], [w["cpu_ms_mean"]] * 2, "-", lw=3, label=f"mean turns {w['turns'][0]}-{w['turns'][1]}")
        c.set(xlabel="turn of one stateless session (drop)", ylabel="runtime process CPU ms / request",
              title="the runtime's own CPU by session length")
        c.legend()
    t = result["targets"]
    fig.suptitle(f"bench/harness.py on {result['machine']['device']}: drop prefill/sglang "
                 f"{t['drop_prefill_over_sglang']}, keep TTFT p50/sglang {t['keep_ttft_p50_over_sglang']}, "
                 f"CPU turn {t['long_turn']}/turn 10 {t['cpu_turn_long_over_turn_10']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="~3 min: 1 session per arm of 3 turns, a 100-turn long session")
    ap.add_argument("--sessions", type=int, default=None, help="sessions per arm (default 2; quick 1)")
    ap.add_argument("--turns", type=int, default=None, help="turns per session (default 5; quick 3)")
    ap.add_argument("--long-turns", type=int, default=None, help="turns of the long session (default 300; quick 100; 0: skip)")
    ap.add_argument("--long-max-tokens", type=int, default=8, help="output cap of the long session's requests")
    ap.add_argument("--long-budget-s", type=float, default=None,
                    help="stop the long session after this many seconds (default 300; quick 90)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--pool-tokens", type=int, default=131072)
    ap.add_argument("--max-context", type=int, default=32768)
    ap.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of the SGLang server")
    ap.add_argument("--model-dir", default=str(Path(tempfile.gettempdir()) / "session-runtime-harness-model"))
    ap.add_argument("--name", default="harness")
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a TERM still stops the servers (finally below)
    sessions_n = args.sessions or (1 if args.quick else 2)
    turns_n = args.turns or (3 if args.quick else 5)
    long_n = args.long_turns if args.long_turns is not None else (100 if args.quick else 300)
    if args.long_budget_s is None:
        args.long_budget_s = 90.0 if args.quick else 300.0

    root = Path(args.model_dir)
    root.mkdir(parents=True, exist_ok=True)
    folder, model_info = build_folder(root)
    print(f"model folder {folder}", flush=True)
    workdir = Path(tempfile.mkdtemp(prefix="harness-bench-"))
    groups: list[Group] = []
    load0 = os.getloadavg()
    try:
        t0 = time.perf_counter()
        sg, sglang_url = start_sglang(args, folder, workdir)
        groups.append(sg)
        sglang_start = time.perf_counter() - t0
        print(f"[sglang] up in {sglang_start:.0f} s at {sglang_url}", flush=True)
        t0 = time.perf_counter()
        rtg, runtime_url = start_runtime(args, folder, sglang_url, workdir)
        groups.append(rtg)
        runtime_start = time.perf_counter() - t0
        print(f"[runtime] up in {runtime_start:.0f} s at {runtime_url}", flush=True)
        rt_proc = psutil.Process(rtg.proc.pid)
        urls = {"sglang": sglang_url, "runtime_drop": runtime_url, "runtime_keep": runtime_url}
        rng = random.Random(args.seed)
        http = httpx.Client(timeout=600)
        # Warm both routes (first requests pay lazy imports and compilation), on throw-away sessions.
        for arm in ARMS:
            w = Session(arm, urls[arm], -1, make_session(rng, 1, 0.3), model_info, random.Random(99))
            while not w.done():
                w.step(http)
        # The same synthetic workload for every arm: session i has the same turns in each.
        plans = [make_session(random.Random(args.seed * 1000 + i), turns_n) for i in range(sessions_n)]
        sessions = {arm: [Session(arm, urls[arm], i, plans[i], model_info, random.Random(args.seed * 1000 + i))
                          for i in range(sessions_n)] for arm in ARMS}
        order = list(ARMS)
        rounds = 0
        cpu_rt0 = rt_proc.cpu_times()
        t_run = time.perf_counter()
        pending = [s for arm in ARMS for s in sessions[arm]]
        while any(not s.done() for s in pending):
            for i in range(sessions_n):
                for arm in order:
                    s = sessions[arm][i]
                    if not s.done():
                        s.step(http)
            order = order[1:] + order[:1]  # rotate who goes first
            rounds += 1
            if rounds % 5 == 0:
                print(f"[arms] round {rounds}: " + ", ".join(
                    f"{arm} {sum(s.pos for s in sessions[arm])}/{sum(len(s.plan) for s in sessions[arm])}"
                    for arm in ARMS), flush=True)
        arms_wall = time.perf_counter() - t_run
        cpu_rt1 = rt_proc.cpu_times()
        time.sleep(2.0)  # let the last canonical branches finish before reading the chains
        arms = {arm: arm_summary(sessions[arm], http, runtime_url) for arm in ARMS}
        stateless_requests = arms["runtime_drop"]["requests"] + arms["runtime_keep"]["requests"]
        arms_cpu = {"runtime_cpu_ms_per_stateless_request": round(
            (cpu_rt1.user + cpu_rt1.system - cpu_rt0.user - cpu_rt0.system) * 1e3 / max(stateless_requests, 1), 2)}
        for arm in ARMS:
            a = arms[arm]
            print(f"{arm:<14} requests {a['requests']:>4} prompt {a['prompt_tokens']:>7} prefill {a['prefill_tokens']:>6} "
                  f"(turn starts {a['prefill_tokens_turn_starts']}, tools {a['prefill_tokens_tool_steps']}) "
                  f"ttft p50 {a['ttft_ms_p50']:.1f} p99 {a['ttft_ms_p99']:.1f} kv/session {a['kv_tokens_per_session']}",
                  flush=True)
        long = None
        if long_n >= 30:
            long = long_session(http, runtime_url, rt_proc, long_n, random.Random(args.seed + 7),
                                args.long_max_tokens, args.long_budget_s)
            print("[long] windows", json.dumps(long["windows"]), flush=True)
        http.close()
        metrics_text = ""
        with contextlib.suppress(Exception):
            metrics_text = httpx.get(sglang_url + "/metrics", timeout=10).text
    finally:
        for g in reversed(groups):
            g.close()

    drop_ratio = arms["runtime_drop"]["prefill_tokens"] / max(arms["sglang"]["prefill_tokens"], 1)
    keep_ttft = arms["runtime_keep"]["ttft_ms_p50"] / arms["sglang"]["ttft_ms_p50"]
    floor = arms["runtime_keep"]["prefill_tokens"]
    floor_ratio = floor / max(arms["sglang"]["prefill_tokens"], 1)
    cpu_ratio = None
    long_reached = long["turns"] if long else None
    if long:
        w = long["windows"]
        # Means, not medians: psutil reads CPU in 10 ms ticks, so one request's figure is a multiple of 10;
        # a window's mean is its total CPU over its requests, exact to a tick over the whole window.
        cpu_ratio = round(w[str(long_reached)]["cpu_ms_mean"] / max(w["10"]["cpu_ms_mean"], 1e-9), 3)
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), platform.machine())
    import sglang

    git = lambda *a: subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True).stdout.strip()  # noqa: E731
    result = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": {"device": f"CPU ({cpu}, {os.cpu_count()} cores), no GPU", "cores": os.cpu_count(),
                    "memory_gib": round(psutil.virtual_memory().total / 2**30, 1), "gpu": None,
                    "python": platform.python_version()},
        "versions": {"sglang": sglang.__version__, "git_commit": git("rev-parse", "HEAD"),
                     "git_dirty": git("status", "--short").splitlines()},
        "settings": {"quick": args.quick, "sessions_per_arm": sessions_n, "turns_per_session": turns_n,
                     "long_session_turns": long_n, "page_size": args.page_size, "pool_tokens": args.pool_tokens,
                     "max_context": args.max_context, "sglang_threads": args.threads, "seed": args.seed,
                     "temperature": 0.0, "context_management": CONTEXT_MGMT},
        "model": {**model_info, "kind": "scripted Qwen3 shape (4 layers, hidden 256, float32), next token = f(current "
                  "token): a fixed reasoning + answer + one tool call; Qwen3 tokenizer; Qwen3 chat template with "
                  "<think>\\n in the generation prompt and compact tool-call markup"},
        "servers": {"sglang_start_s": round(sglang_start, 1), "runtime_start_s": round(runtime_start, 1),
                    "sglang_flags": "--radix-cache-backend session --enable-cache-report --reasoning-parser qwen3 "
                                    "--tool-call-parser hermes --sleep-on-idle --enable-priority-scheduling "
                                    "(tokenizer on: its /v1/messages route needs it)",
                    "runtime_flags": "serve --backend sglang --sglang-url <that server> --template hf --offload never"},
        "arms": arms,
        "arms_wall_s": round(arms_wall, 1),
        "arms_runtime_cpu": arms_cpu,
        "long_session": long,
        "targets": {
            "drop_prefill_over_sglang": round(drop_ratio, 3),
            "drop_prefill_at_most_0.5x_sglang": drop_ratio <= 0.5,
            # keep re-prefills nothing: its request-path prefill is the first request's prompt and every
            # request's new messages, which no server can skip (the floor under drop too, whose canonical
            # branch is prefilled in idle time).
            "floor_over_sglang": round(floor_ratio, 3),
            "drop_prefill_over_floor": round(arms["runtime_drop"]["prefill_tokens"] / max(floor, 1), 3),
            "keep_ttft_p50_over_sglang": round(keep_ttft, 3),
            "keep_ttft_p50_within_5pct_of_sglang": abs(keep_ttft - 1) <= 0.05,
            "keep_ttft_p50_not_worse_than_1.05x_sglang": keep_ttft <= 1.05,
            "long_turn": long_reached,
            "long_turn_asked": long_n,
            "cpu_turn_long_over_turn_10": cpu_ratio,
            "cpu_turn_long_at_most_1.5x_turn_10": None if cpu_ratio is None else cpu_ratio <= 1.5,
        },
        "requests": {arm: [s.rows for s in sessions[arm]] for arm in ARMS},
        "sglang_metrics_cache": [ln for ln in metrics_text.splitlines()
                                 if "cache" in ln and not ln.startswith("#")][:20],
        "notes": NOTES,
        "wall_s": round(time.perf_counter() - _T0, 1),
        "loadavg": {"start": list(load0), "end": list(os.getloadavg())},
        "logs": str(workdir),
    }
    js, png = write_report(args.name, result, plot)
    print(json.dumps(result["targets"], indent=1))
    print(f"wall {result['wall_s']:.0f} s -> {js}, {png}")


NOTES = {
    "arms": "One SGLang server serves all three arms: `sglang` talks to its own /v1/messages (Anthropic) route, "
            "the runtime arms to the runtime's /v1/messages, which steps inferred conversations on the same "
            "server's session backend. Plain requests carry no session, so for them the session backend is "
            "SGLang's radix cache (match, insert, LRU). Each (session, arm) has its own system prompt.",
    "prefill": "Request-path prefill = the answer's usage.input_tokens (Anthropic: the uncached part of the "
               "prompt); SGLang computes it from its cached_tokens (--enable-cache-report). The runtime's "
               "idle-time canonical-branch prefill is not on the request path; it is given per arm as "
               "idle_materialized_prefill_tokens (from GET /v1/conversations/{id}).",
    "ttft": "Client side: request sent -> first content_block_delta of the stream, every request of the arm "
            "(turn starts and tool steps). The arms alternate request by request, one request in flight at a time.",
    "output": "A tool step asks max_tokens = the chain + 4 and ends at <|im_end|> after its tool call; a turn's "
              "last step asks max_tokens = reasoning + answer text, so it stops on max_tokens without a call. "
              "Output is identical in every step, generated (greedy) by the scripted model.",
    "kv": "runtime: GET /v1/conversations/{id} chain.cached_tokens (KV the chain holds on the device). SGLang "
          "locks nothing per session; its figure is the tokens the session's requests inserted into the tree "
          "(prefill + output), all evictable, none evicted in a pool this size.",
    "cpu": "Long session: one stateless session on the runtime (drop), each turn a 20-word user message and a "
           "short answer (--long-max-tokens, thinking only); the runtime process's CPU (user+system, every thread, "
           "psutil) from send to the end of the stream, medians over turns 5-15 and the last 11 turns. SGLang is "
           "another process and not counted.",
    "stream_repair": "The runtime's streamed /v1/messages answer (this model: the generation prompt opens the think "
                     "block, so the output starts with reasoning) arrives as a text block holding the reasoning, "
                     "then a thinking block with the same reasoning and its signature, and no text block with the "
                     "answer; the non-streamed answer is right (thinking, text, tool_use). Echoed as streamed, the "
                     "history matches no stored conversation and every request starts a new one (measured before the "
                     "repair: 9 requests, 9 conversations). The client repairs what it echoes (drops the text copy, "
                     "puts the scripted answer's text after the thinking block): `streams_repaired` counts it. "
                     "TTFT is still the stream's first delta.",
    "long_budget": "The long session stops once it has run --long-budget-s seconds (its per-request time grows with "
                   "its length); `long_session.turns` is the turn reached, and the target compares the median CPU "
                   "of its last 11 turns with turns 5-15.",
    "machine": "2-core CPU machine shared by the client, the runtime and SGLang (all on the same cores); "
               "absolute times are CPU times; ratios are the point.",
}


if __name__ == "__main__":
    main()
