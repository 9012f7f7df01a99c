"""SGLang benchmark: cache policies per turn (Part A) and step throughput (Part B)
on SGLang's real server, plain and with our `session` radix-cache backend.

    .venv/bin/python bench/sglang_server.py [--quick] [--turns 8] [--seed 0] [--duration 16] [--reps 2]
                                     [--rounds 2] [--concurrency 1,8,32] [--pool-tokens 262144] [--name sglang]
    # issue 21's side-by-side check of the session layer (Part B only, one server):
    .venv/bin/python bench/sglang_server.py --skip part_a,embedded,plain_strip,plain --concurrency 1,8,32 \
        --duration 14 --rounds 2 --name sglang_layer

Writes bench/results/NAME.json and bench/results/NAME.png (NAME: sglang). One run, one
model folder (the `tiny` preset's random weights, exported once as a Hugging
Face folder), one seeded workload. The servers run one after the other, never
two at once, each stopped (its whole process group) before the next starts:

1. plain SGLang (default radix cache, no session): Part A mode `plain`, Part B (ii);
2. plain SGLang with --strip-thinking-cache: Part A mode `plain_strip_flag`;
3. SGLang with `--radix-cache-backend session`, through the Runtime: Part A modes
   `session_drop_never`, `session_drop_always` and the supplementary
   `session_strip_emulated` (policy strip_thinking_cache: our per-request
   emulation of the flag, which caches only each request's prompt), then Part B (iii);
4. the embedded engine in this process (no server): Part B (i).

Part A replays a multi-turn tool-calling agent with forced output (|R| = 5-20x
|A| per step); every mode renders the same prompts (the deepseek template;
closed turns drop their reasoning), so every difference is the cache. Plain
SGLang gets the forced ids as input_ids with max_new_tokens=0, exactly what the
runtime's SGLang backend sends. Each turn's first step is preceded by a probe:
a greedy 1-token sampled request on the same prompt (plain: /generate without
session; ours: the backend's step with a throw-away owner that holds nothing),
whose time to first token is the next-turn TTFT and whose cached_tokens give
the first step's prefill; it leaves only the prompt's full pages in the tree,
a prefix of the forced step that follows, so it adds no orphan.

Part B: C threads, one conversation per agent (a fresh one per step, so every
prompt is ~200 tokens, all of it prefilled; conversations are deleted after
each level, untimed), sampled (32 greedy tokens) and forced (32 tokens, no
target) steps, steps/s and p50/p99 step latency, for the embedded engine,
plain SGLang (raw /generate) and the Runtime on our backend; on the session
server raw /generate runs too, alternated with the Runtime in rounds, so the
session layer's own cost is measured under the same load.

`--quick` (3 turns, 2 s levels, 1 and 8 agents) skips the --strip-thinking-cache server
(`--strip-server on` runs it). The JSON's `notes` give the methodology.
"""

from __future__ import annotations

import time as _time

_T0 = _time.perf_counter()  # the run's wall time counts the imports too

import argparse
import contextlib
import json
import os
import platform
import random
import statistics
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

# This file is named like the package it measures: run as a script, its own
# folder comes first on sys.path and `import sglang` would import this file.
# Move bench/ to the end (report.py is still found) and put the repo root first.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or os.getcwd()).resolve() != _HERE] + [str(_HERE)]
sys.path.insert(0, str(_HERE.parent))

import httpx  # noqa: E402
import orjson  # noqa: E402

from procstat import TICK, cpu_s, machine_ticks, stat_fields  # noqa: E402
from report import RESULTS, write_report  # noqa: E402

from session_runtime.backends.base import StepRequest  # noqa: E402
from session_runtime.backends.sglang.launcher import LaunchSpec, LaunchedServer, launch  # noqa: E402
from session_runtime.backends.sglang.generate import sse_chunks  # noqa: E402
from session_runtime.direct_http import DirectPool  # noqa: E402
from session_runtime.config import RuntimeConfig  # noqa: E402
from session_runtime.runtime import Runtime  # noqa: E402
from session_runtime.sampling import SamplingParams  # noqa: E402
from session_runtime.templates import Message, ToolCall, build_template  # noqa: E402
from session_runtime.tokenizer import load_tokenizer  # noqa: E402

WORDS = ("alpha beta gamma delta search file result check value plan step code test data model cache "
         "token query answer error path read write list node tree page time").split()
TOOLS = [{"name": n, "description": f"{n} over the workspace",
          "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}
         for n in ("search", "read_file", "run_tests")]
MODES = {  # Part A: label -> (server, Runtime conversation kwargs or None for a raw /generate client)
    "plain": ("plain", None),
    "plain_strip_flag": ("plain_strip", None),
    "session_drop_never": ("session", {"policy": "drop", "materialize": "never"}),
    "session_drop_always": ("session", {"policy": "drop", "materialize": "always"}),
    "session_strip_emulated": ("session", {"policy": "strip_thinking_cache"}),
}
NEW_TOKENS = 32
TARGET_SPEEDUP = 3.0


def words(rng: random.Random, n: int) -> str:
    """n words, each exactly one DeepSeek token (checked in make_trace)."""
    return "".join(" " + rng.choice(WORDS) for _ in range(n))


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100])."""
    s = sorted(values)
    if not s:
        return float("nan")
    return s[max(0, min(len(s) - 1, int(round(q / 100 * len(s) + 0.5)) - 1))]


# ----- Part A: the workload ---------------------------------------------------------


def make_trace(tpl, seed: int, turns: int, scale: float, calls: tuple[int, int], system_words: int) -> dict:
    """Per turn: a user message, `calls` tool steps (one call each) and a final
    answer; every step's reasoning is 5-20x its answer (content + call markup)."""
    assert all(len(tpl.tok.encode(" " + w)) == 1 for w in WORDS)
    rng = random.Random(seed)
    size = lambda lo, hi: rng.randint(max(1, round(lo * scale)), max(1, round(hi * scale)))  # noqa: E731
    system = "You are a careful coding agent." + words(rng, system_words)
    out = []
    for _ in range(turns):
        n = rng.randint(*calls)
        steps, results, sizes = [], [], []
        for k in range(n + 1):
            tc = [] if k == n else [{"name": rng.choice(TOOLS)["name"],
                                     "arguments": {"query": words(rng, size(3, 8)).strip()}}]
            calls_ = [ToolCall("", c["name"], c["arguments"]) for c in tc]
            markup = len(tpl.forced_ids("", "", calls_)) - 2
            content = words(rng, max(size(20, 50) - markup, 2))
            a = len(tpl.forced_ids("", content, calls_)) - 2  # without </think> and eos
            ratio = rng.uniform(5, 20)
            r = round(ratio * a)
            steps.append({"reasoning": words(rng, r), "content": content, "tool_calls": tc})
            sizes.append({"answer_tokens": a, "reasoning_tokens": r, "ratio": round(r / a, 2)})
            if k < n:
                results.append(words(rng, size(20, 60)))
        out.append({"user": "Next:" + words(rng, size(10, 30)), "steps": steps, "results": results, "sizes": sizes})
    return {"system": system, "turns": out}


class ClientConversation:
    """What a client of plain SGLang keeps: the conversation's canonical history,
    rendered as the runtime renders it (StepPath.run / _commit / TurnClose.close
    under policy drop: closed turns lose their reasoning, the open turn's tool
    chain replays its generated ids exactly)."""

    def __init__(self, tpl, system: str, tools: list):
        self.tpl, self.system, self.tools = tpl, system, tools
        self.history: list[Message] = []
        self.closed = 0
        self.step_in_turn = 0
        self.pending: list = []

    def keep(self):
        closed = self.closed
        return lambda turn: turn >= closed

    def render(self, new: list[Message]) -> tuple[list[int], int]:
        """(prompt ids, tokens before the new messages)."""
        tpl, keep = self.tpl, self.keep()
        prompt = tpl.render(self.system, self.tools, self.history + new, keep, True).ids
        hist = len(tpl.render(self.system, self.tools, self.history, keep, False).ids) if self.history else 0
        return prompt, hist

    def user(self, text: str) -> list[Message]:
        self.step_in_turn = 0
        return [Message("user", self.closed, text)]

    def results(self, contents: list[str]) -> list[Message]:
        assert len(contents) == len(self.pending)
        return [Message("tool", self.closed, content=c, tool_call_id=call.id) for call, c in zip(self.pending, contents)]

    def commit(self, new: list[Message], output: list[int]) -> bool:
        """Record a step; returns True when it closed the turn."""
        turn = self.closed
        parsed = self.tpl.parse_output(output, f"call_{turn}_{self.step_in_turn}")
        self.history += [*new, Message("assistant", turn, content=parsed.content, reasoning=parsed.reasoning,
                                       tool_calls=parsed.tool_calls, output_ids=tuple(output))]
        self.step_in_turn += 1
        if parsed.tool_calls:
            self.pending = list(parsed.tool_calls)
            return False
        self.pending = []
        self.closed += 1
        keep = self.keep()
        self.history = [self.tpl.strip_reasoning(m) if m.role == "assistant" and not keep(m.turn) and m.reasoning
                        else m for m in self.history]
        return True

    def canonical(self) -> list[int]:
        """The history every later prompt of this conversation starts with."""
        return self.tpl.render(self.system, self.tools, self.history, self.keep(), False).ids


class Shadow:
    """A page-level shadow of plain SGLang's radix tree: what each finished
    request inserted (its computed tokens cut to whole pages). Pages are the
    tree's unit: two sequences that part mid-page each keep their own copy of
    that page. The pool is sized so that nothing is evicted, so the shadow is
    the tree; each request's predicted cached_tokens is checked against the
    server's."""

    def __init__(self, page_size: int):
        self.ps = page_size
        self.root: dict = {}
        self.pages = 0

    @property
    def size(self) -> int:
        """Tokens (KV slots) the tree holds."""
        return self.pages * self.ps

    def insert(self, seq: list[int]) -> None:
        node, ps = self.root, self.ps
        for i in range(0, len(seq) // ps * ps, ps):
            page = tuple(seq[i: i + ps])
            nxt = node.get(page)
            if nxt is None:
                nxt = node[page] = {}
                self.pages += 1
            node = nxt

    def match(self, seq: list[int]) -> int:
        """Tokens of seq's longest whole-page prefix that the tree holds."""
        node, ps, n = self.root, self.ps, 0
        for i in range(0, len(seq) // ps * ps, ps):
            node = node.get(tuple(seq[i: i + ps]))
            if node is None:
                break
            n += ps
        return n


# ----- servers ------------------------------------------------------------------------


@dataclass(frozen=True)
class PlainSpec(LaunchSpec):
    """The launcher's spec minus `--radix-cache-backend session`: SGLang's own
    default radix cache (our CPU platform still switches on for --device cpu)."""

    def argv(self, port: int) -> list[str]:
        argv = super().argv(port)
        i = argv.index("--radix-cache-backend")
        del argv[i: i + 2]
        return argv


def ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=5.0).status_code == 200
    except httpx.HTTPError:
        return False


def spec_for(args, folder: Path, extra: tuple[str, ...] = (), plain: bool = True, log: str = "") -> LaunchSpec:
    cls = PlainSpec if plain else LaunchSpec
    return cls(model_path=str(folder), page_size=args.page_size, max_total_tokens=args.pool_tokens,
               dtype="float32", device="cpu", context_length=args.max_context, max_running_requests=args.max_running,
               seed=args.seed, extra_args=extra, log_path=log or None)


def flush(url: str) -> None:
    """Empty the server's tree between modes (SGLang refuses while requests run)."""
    for _ in range(50):
        r = httpx.post(f"{url}/flush_cache", timeout=60)
        if r.status_code == 200:
            return
        time.sleep(0.2)
    raise RuntimeError(f"{url}/flush_cache kept failing: {r.status_code} {r.text[:200]}")


def generate(http: DirectPool, url: str, ids: list[int], max_new: int, stop: list[int]) -> dict:
    """One streamed /generate, as the runtime's SGLang backend sends it minus
    session_id, kv_hints and namespace keys, over the same HTTP client (so that
    the two differ by the runtime's layer only). Returns output ids, meta_info,
    time to first chunk and total time (ms)."""
    body = {"input_ids": ids, "stream": True,
            "sampling_params": {"temperature": 0.0, "max_new_tokens": max_new, "stop_token_ids": stop}}
    t0 = time.perf_counter()
    first, final = None, {}
    with http.post("/generate", orjson.dumps(body), {"content-type": "application/json"}) as resp:
        if resp.status >= 400:
            raise RuntimeError(f"/generate: HTTP {resp.status}: {resp.read()[:300]!r}")
        for chunk in sse_chunks(resp.iter_lines()):
            if "error" in chunk:
                raise RuntimeError(f"/generate: {chunk['error']}")
            if first is None and (chunk.get("output_ids") or max_new == 0):
                first = time.perf_counter()
            final = chunk
    end = time.perf_counter()
    meta = final.get("meta_info") or {}
    if (meta.get("finish_reason") or {}).get("type") == "abort":
        raise RuntimeError(f"/generate aborted: {meta.get('finish_reason')}")
    return {"output": final.get("output_ids") or [], "meta": meta,
            "ttft_ms": ((first or end) - t0) * 1e3, "total_ms": (end - t0) * 1e3}


def kv_bytes_per_token(folder: Path) -> int:
    raw = json.loads((folder / "config.json").read_text())
    head_dim = raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"]
    return 2 * raw["num_hidden_layers"] * raw.get("num_key_value_heads", raw["num_attention_heads"]) * head_dim * 4


# ----- Part A: one mode ---------------------------------------------------------------


def turn_row(first: dict, tools: list[dict], fstep_ms: float) -> dict:
    return {
        "first_prompt_tokens": first["prompt"], "first_cached_tokens": first["cached"],
        "first_step_prefill": first["prompt"] - first["cached"], "ttft_ms": first["ttft_ms"],
        "forced_first_step_ms": fstep_ms,
        "tool_chain_prefill": sum(t["prompt"] - t["cached"] for t in tools),
        "ttft_cpu": "On this CPU platform TTFT follows the context length, not the cached share: SGLang's torch_native "
                "attention (the only attention backend on a plain CPU) pads each request's query to the whole "
                "sequence and runs causal SDPA over sequence x sequence (torch_native_backend."
                "_run_sdpa_forward_extend), so an extend of 26 new tokens on a 3.6k cached prefix still pays the full "
                "quadratic attention; with the tiny model's 4 layers that dominates. The prefill-token columns show "
                "the cache's effect; a GPU attention backend (flashinfer, FA3) computes only the new rows and would "
                "turn them into TTFT.",
    "tool_chain_recomputed": sum(max(0, t["history"] - t["cached"]) for t in tools),
        "tool_steps": [{"prompt": t["prompt"], "cached": t["cached"], "history": t["history"],
                        "recomputed": max(0, t["history"] - t["cached"]), "ms": t["ms"]} for t in tools],
        "forced_tokens": first["forced"] + sum(t["forced"] for t in tools),
    }


def play_plain(label: str, url: str, trace: dict, tpl, ps: int, bpt: int) -> dict:
    """A raw /generate client: the canonical history rendered client-side."""
    http = DirectPool(url)
    conv = ClientConversation(tpl, trace["system"], TOOLS)
    shadow, rows, mismatches, stop = Shadow(ps), [], [], sorted(tpl.stop_token_ids)

    def send(ids: list[int], max_new: int) -> dict:
        predicted = shadow.match(ids[:-1])
        res = generate(http, url, ids, max_new, stop)
        cached = int(res["meta"].get("cached_tokens") or 0)
        if cached != predicted:
            mismatches.append({"turn": conv.closed, "predicted": predicted, "reported": cached})
        computed = ids + res["output"][:-1] if max_new else ids  # the last sampled token is never fed
        shadow.insert(computed)
        res["cached"] = cached
        return res

    for turn in trace["turns"]:
        new = conv.user(turn["user"])
        prompt, hist = conv.render(new)
        probe = send(prompt, 1)  # the next-turn TTFT probe: 1 greedy token
        forced = tpl.forced_ids(**_forced_args(turn["steps"][0]))
        res = send(prompt + forced, 0)
        first = {"prompt": len(prompt), "cached": probe["cached"], "ttft_ms": probe["ttft_ms"], "forced": len(forced)}
        fstep_ms = res["total_ms"]
        conv.commit(new, forced)
        tools = []
        for result, step in zip(turn["results"], turn["steps"][1:]):
            new = conv.results([result])
            prompt, hist = conv.render(new)
            forced = tpl.forced_ids(**_forced_args(step))
            res = send(prompt + forced, 0)
            cached = min(res["cached"], len(prompt))
            tools.append({"prompt": len(prompt), "cached": cached, "history": hist, "ms": res["total_ms"],
                          "forced": len(forced)})
            closed = conv.commit(new, forced)
        assert closed, "the last step of a turn must close it"
        canonical = conv.canonical()
        reusable = shadow.match(canonical + [0])
        row = turn_row(first, tools, fstep_ms)
        row.update({"tree_bytes": shadow.size * bpt, "chain_bytes": 0,
                    "orphaned_bytes": (shadow.size - reusable) * bpt, "reusable_bytes": reusable * bpt,
                    "orphaned_source": "shadow: tree tokens minus the page-aligned match of the next canonical prompt",
                    "idle_prefill_tokens": 0, "idle_ms": 0.0, "canonical_tokens": len(canonical)})
        rows.append(row)
        print(f"  {label} turn {len(rows) - 1}: first-step prefill {row['first_step_prefill']}, ttft "
              f"{row['ttft_ms']:.1f} ms, tool recomputed {row['tool_chain_recomputed']}, orphaned "
              f"{row['orphaned_bytes'] / 2**20:.2f} MiB", flush=True)
    http.close()
    return {"turns": rows, "shadow_mismatches": mismatches, "prompts": conv}


def _forced_args(step: dict) -> dict:
    return {"reasoning": step["reasoning"], "content": step["content"],
            "tool_calls": [ToolCall("", c["name"], c["arguments"]) for c in step["tool_calls"]]}


def play_runtime(label: str, rt: Runtime, trace: dict, kwargs: dict, tpl, ps: int, bpt: int) -> dict:
    """Our backend through the Runtime's Python API; a ClientConversation renders
    alongside and checks the runtime sends the very prompts plain SGLang gets."""
    backend = rt.backend
    cid = rt.create_conversation(trace["system"], tools=TOOLS, **kwargs)
    shadow_conv = ClientConversation(tpl, trace["system"], TOOLS)
    rows, checks = [], {"prompts_equal": True, "evictable_equals_stale": True}
    for turn in trace["turns"]:
        conv = rt.get(cid)
        new = shadow_conv.user(turn["user"])
        prompt, _ = shadow_conv.render(new)
        keep = conv.policy.kept_turns(conv.closed_turns)
        assert tpl.render(conv.system, conv.tools, conv.history + new, keep, True).ids == prompt
        ns = rt.namespace(conv)
        # The TTFT probe: a greedy 1-token step under a throw-away owner that holds nothing.
        probe = backend.step(StepRequest(owner=f"probe-{uuid.uuid4().hex[:8]}", prompt=prompt, namespace=ns,
                                         sampling=SamplingParams(max_tokens=1, stop_token_ids=tpl.stop_token_ids),
                                         hold_chain=False))
        t = time.perf_counter()
        step = rt.send_message(cid, turn["user"], max_tokens=1, forced=turn["steps"][0])
        fstep_ms = (time.perf_counter() - t) * 1e3
        forced = list(step.output_ids)
        first = {"prompt": len(prompt), "cached": probe.accounting.cached_input_tokens,
                 "ttft_ms": probe.accounting.ttft_ms, "forced": len(forced)}
        checks["prompts_equal"] &= step.accounting.prompt_tokens == len(prompt)
        shadow_conv.commit(new, forced)
        tools = []
        for result, fstep in zip(turn["results"], turn["steps"][1:]):
            new = shadow_conv.results([result])
            prompt, hist = shadow_conv.render(new)
            t = time.perf_counter()
            step = rt.send_tool_results(cid, [{"tool_call_id": c["id"], "content": result} for c in step.tool_calls],
                                        max_tokens=1, forced=fstep)
            ms = (time.perf_counter() - t) * 1e3
            acc = step.accounting
            checks["prompts_equal"] &= acc.prompt_tokens == len(prompt) and acc.recomputed_history_tokens == max(
                0, hist - acc.cached_input_tokens)
            tools.append({"prompt": acc.prompt_tokens, "cached": acc.cached_input_tokens, "history": hist,
                          "ms": ms, "forced": acc.output_tokens})
            closed = shadow_conv.commit(new, list(step.output_ids))
        assert closed and step.finish_reason == "forced" and not step.tool_calls
        before = rt.materializer.stats["prefill_tokens"]
        t = time.perf_counter()
        assert rt.materializer.wait_idle(timeout=600), "the canonical branch did not finish"
        idle_ms = (time.perf_counter() - t) * 1e3
        canonical = shadow_conv.canonical()
        pools = backend.pools()
        total = pools["evictable"] + pools["protected"]
        reusable = backend.probe(ns, canonical + [0]).device_len
        chain = pools["chains"].get(cid, 0)
        holds = rt.get(cid).policy.holds_chain
        orphaned = pools["evictable"] if holds else total - reusable
        if holds:
            checks["evictable_equals_stale"] &= pools["evictable"] == total - reusable
        row = turn_row(first, tools, fstep_ms)
        row.update({"tree_bytes": total * bpt, "chain_bytes": chain * bpt, "orphaned_bytes": orphaned * bpt,
                    "evictable_bytes": pools["evictable"] * bpt, "stale_bytes": (total - reusable) * bpt,
                    "reusable_bytes": reusable * bpt,
                    "orphaned_source": ("the `pools` command: evictable tokens" if holds else
                                        "tree tokens (pools) minus the next canonical prompt's probe "
                                        "(nothing is held: everything is evictable)"),
                    "idle_prefill_tokens": rt.materializer.stats["prefill_tokens"] - before, "idle_ms": idle_ms,
                    "canonical_tokens": len(canonical), "cache_state_reported": rt.get(cid).turns[-1].cache_state})
        rows.append(row)
        print(f"  {label} turn {len(rows) - 1}: first-step prefill {row['first_step_prefill']}, ttft "
              f"{row['ttft_ms']:.1f} ms, tool recomputed {row['tool_chain_recomputed']}, orphaned "
              f"{row['orphaned_bytes'] / 2**20:.2f} MiB, idle prefill {row['idle_prefill_tokens']}", flush=True)
    rt.check_integrity()
    rt.delete_conversation(cid)
    return {"turns": rows, "checks": checks}


TIMED = ("ttft_ms", "forced_first_step_ms", "idle_ms", "tool_steps")


def summarize_mode(reps: list[dict]) -> dict:
    """Token and byte figures from the first repetition (checked identical across
    repetitions); TTFT, step and idle times as per-turn medians over them."""
    res = reps[0]
    t = res["turns"]
    strip = lambda r: [{k: v for k, v in row.items() if k not in TIMED} for row in r["turns"]]  # noqa: E731
    out = {k: v for k, v in res.items() if k != "prompts"}
    out["repetitions"] = len(reps)
    out["deterministic"] = all(strip(r) == strip(res) for r in reps)
    for i, row in enumerate(t):
        row["ttft_ms_reps"] = [round(r["turns"][i]["ttft_ms"], 2) for r in reps]
        for key in ("ttft_ms", "forced_first_step_ms", "idle_ms"):
            row[key] = statistics.median(r["turns"][i][key] for r in reps)
    if "shadow_mismatches" in res:
        out["shadow_mismatches"] = [m for r in reps for m in r["shadow_mismatches"]]
    if "checks" in res:
        out["checks"] = {k: all(r["checks"][k] for r in reps) for k in res["checks"]}
    later = t[1:] or t
    out["totals"] = {k: sum(r[k] for r in t) for k in ("first_step_prefill", "tool_chain_prefill",
                                                        "tool_chain_recomputed", "idle_prefill_tokens", "forced_tokens")}
    out["totals"]["prefill_tokens"] = out["totals"]["first_step_prefill"] + out["totals"]["tool_chain_prefill"]
    out["next_turn_ttft_median_ms"] = statistics.median(r["ttft_ms"] for r in later)
    out["next_turn_first_step_prefill_median"] = statistics.median(r["first_step_prefill"] for r in later)
    out["final_orphaned_bytes"] = t[-1]["orphaned_bytes"]
    out["final_tree_bytes"] = t[-1]["tree_bytes"]
    out["final_chain_bytes"] = t[-1]["chain_bytes"]
    return out


# ----- Part B: throughput -----------------------------------------------------------


def b_prompt(rng_seed: int, agent: int, n: int, sys_words: int, user_words: int) -> tuple[str, str]:
    rng = random.Random(rng_seed * 1_000_003 + agent * 10_007 + n)
    system = f"Agent {agent} conversation {n}." + words(rng, sys_words)
    return system, f"Step {n}:" + words(rng, user_words)


def b_forced(rng_seed: int) -> dict:
    """22 reasoning words + </think> + 8 content words + eos: 32 forced tokens."""
    rng = random.Random(rng_seed + 17)
    return {"reasoning": words(rng, NEW_TOKENS - 10).strip(), "content": words(rng, 8).strip()}


def cpu_busy_s() -> float:
    """CPU seconds this machine has been busy (all cores, all processes), from /proc/stat."""
    return machine_ticks()[0] / TICK


def group_cpu_s(pgids: set[int]) -> float:
    """CPU seconds of the live processes in these process groups."""
    stats = (stat_fields(pid) for pid in os.listdir("/proc") if pid.isdigit())
    return sum(cpu_s(f) for f in stats if f is not None and int(f[2]) in pgids)


class Contention:
    """CPU time other jobs on this machine took during a measurement: busy time
    of the whole machine minus this process's and the server's process group's."""

    def __init__(self, server_pgid: Optional[int]):
        self.server = {server_pgid} if server_pgid else set()

    def _ours(self) -> float:
        t = os.times()
        return t.user + t.system + (group_cpu_s(self.server) if self.server else 0.0)

    def __enter__(self):
        t = os.times()
        self.t0, self.busy0, self.ours0 = time.perf_counter(), cpu_busy_s(), self._ours()
        self.client0 = t.user + t.system
        return self

    def __exit__(self, *exc):
        wall = time.perf_counter() - self.t0
        t = os.times()
        ours = self._ours() - self.ours0
        client = t.user + t.system - self.client0
        foreign = max(0.0, (cpu_busy_s() - self.busy0) - ours)
        self.result = {"wall_s": round(wall, 2), "foreign_cpu_s": round(foreign, 2),
                       "foreign_cpu_share": round(foreign / (wall * os.cpu_count()), 3),
                       "client_cpu_s": round(client, 2), "server_cpu_s": round(ours - client, 2),
                       "loadavg_1m": os.getloadavg()[0]}
        return False


def drive(concurrency: int, duration: float, step_fn: Callable[[int, int], tuple[float, int]]) -> dict:
    """C threads call step_fn(agent, n) until the deadline; it returns (latency
    ms, generated tokens). Steps in flight at the deadline finish and count.
    Returns the records and the wall time (start to the last finish)."""
    recs: list[tuple[float, int]] = []
    errors: list[BaseException] = []
    lock = threading.Lock()
    go = threading.Barrier(concurrency + 1)
    deadline = [0.0]
    ends: list[float] = []

    def run(agent: int) -> None:
        try:
            go.wait()
            n = 0
            while time.perf_counter() < deadline[0]:
                lat, toks = step_fn(agent, n)
                with lock:
                    recs.append((lat, toks))
                n += 1
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)
        finally:
            with lock:
                ends.append(time.perf_counter())

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(concurrency)]
    for t in threads:
        t.start()
    t0 = time.perf_counter()
    deadline[0] = t0 + duration
    go.wait()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return {"records": recs, "wall_s": max(ends) - t0}


def level_row(concurrency: int, parts: list[dict], contention: list[dict]) -> dict:
    recs = [r for p in parts for r in p["records"]]
    wall = sum(p["wall_s"] for p in parts)
    lat, toks = [r[0] for r in recs], [r[1] for r in recs]
    commands = [p["commands"] for p in parts if "commands" in p]
    extra = {} if not commands else {"commands_per_step": {
        k: round(sum(c[k] for c in commands) / max(len(recs), 1), 3) for k in commands[0]}}
    return {**extra, "concurrency": concurrency, "steps": len(recs), "wall_s": round(wall, 3), "rounds": len(parts),
            "steps_per_s": round(len(recs) / wall, 3), "generated_tokens_per_s": round(sum(toks) / wall, 2),
            "p50_ms": round(percentile(lat, 50), 2), "p99_ms": round(percentile(lat, 99), 2),
            "mean_ms": round(statistics.fmean(lat), 2),
            "steps_short_of_target": sum(1 for t in toks if t < NEW_TOKENS),
            "generated_tokens_mean": round(statistics.fmean(toks), 2),
            "cpu_s": {"client": round(sum(c["client_cpu_s"] for c in contention), 2),
                      "server": round(sum(c["server_cpu_s"] for c in contention), 2)},
            "contention": {"foreign_cpu_s": round(sum(c["foreign_cpu_s"] for c in contention), 2),
                           "foreign_cpu_share_max": max(c["foreign_cpu_share"] for c in contention),
                           "loadavg_1m_end": contention[-1]["loadavg_1m"]}}


class RuntimeAgents:
    """Agents on the Runtime's Python API: a fresh conversation per step (its
    first turn, ~200-token prompt); conversations deleted after each run, untimed."""

    def __init__(self, rt: Runtime, args, kind: str, tag: str):
        self.rt, self.args, self.tag = rt, args, tag
        self.forced = b_forced(args.seed) if kind == "forced" else None
        self.cids: list[str] = []
        self.lock = threading.Lock()
        self.run_id = 0

    def run(self, c: int, duration: float) -> dict:
        self.run_id += 1
        rt, args, run_id = self.rt, self.args, self.run_id

        def step_fn(agent: int, n: int) -> tuple[float, int]:
            system, user = b_prompt(args.seed, agent, n + 100_000 * run_id, args.b_system_words, args.b_user_words)
            cid = rt.create_conversation(f"[{self.tag} c{c}] " + system, policy="drop", materialize="never")
            with self.lock:
                self.cids.append(cid)
            t = time.perf_counter()
            step = rt.send_message(cid, user, max_tokens=NEW_TOKENS, temperature=0.0, forced=self.forced)
            lat = (time.perf_counter() - t) * 1e3
            return lat, step.accounting.output_tokens if self.forced is None else len(step.output_ids)

        backend = rt.backend
        before = (backend.waited_commands, backend.after.sent, backend.renewals)
        try:
            out = drive(c, duration, step_fn)
            waited, after, renewals = (a - b for a, b in zip(
                (backend.waited_commands, backend.after.sent, backend.renewals), before))
            # Commands (server round trips besides each step's /generate) made while
            # the steps ran: waited for (on a step's path: creating and stepping a
            # conversation makes none), or sent after a step answered (off its path).
            out["commands"] = {"on_step_path": waited, "after_step": after, "lease_renewals": renewals}
            return out
        finally:
            for cid in self.cids:
                rt.delete_conversation(cid)
            self.cids.clear()


class RawAgents:
    """Agents that POST /generate directly (the same body the runtime's backend
    sends minus session_id, kv_hints and namespace keys), streamed, with the
    prompt the runtime would render for a fresh conversation. `burn_ms`: each
    step then spends that much of its thread's CPU in Python (holding the GIL)
    after its answer, inside its timing, as the runtime's bookkeeping would."""

    def __init__(self, url: str, tpl, args, kind: str, tag: str, burn_ms: float = 0.0):
        self.url, self.tpl, self.args, self.tag, self.burn_ms = url, tpl, args, tag, burn_ms
        self.forced = tpl.forced_ids(**_forced_args({**b_forced(args.seed), "tool_calls": []})) if kind == "forced" else None
        self.stop = sorted(tpl.stop_token_ids)
        self.run_id = 0

    def run(self, c: int, duration: float) -> dict:
        self.run_id += 1
        run_id, http = self.run_id, DirectPool(self.url)

        def step_fn(agent: int, n: int) -> tuple[float, int]:
            system, user = b_prompt(self.args.seed, agent, n + 100_000 * run_id, self.args.b_system_words,
                                    self.args.b_user_words)
            prompt = self.tpl.render(f"[{self.tag} c{c}] " + system, [], [Message("user", 0, user)],
                                     lambda t: True, True).ids
            if self.forced is None:
                res = generate(http, self.url, prompt, NEW_TOKENS, self.stop)
                return res["total_ms"] + self._burn(), len(res["output"])
            res = generate(http, self.url, prompt + self.forced, 0, self.stop)
            return res["total_ms"] + self._burn(), len(self.forced)

        try:
            return drive(c, duration, step_fn)
        finally:
            http.close()

    def _burn(self) -> float:
        """Spend burn_ms of this thread's CPU in bytecode; returns the wall ms it took."""
        if self.burn_ms <= 0:
            return 0.0
        t0, end = time.perf_counter(), time.thread_time() + self.burn_ms / 1e3
        while time.thread_time() < end:
            pass
        return (time.perf_counter() - t0) * 1e3


def part_b(drivers: dict[str, object], levels: list[int], duration: float, rounds: int,
           server_pgid: Optional[int]) -> dict[str, list[dict]]:
    """Each level: `rounds` alternations of every driver (so load from other jobs
    hits them alike), duration/rounds seconds each; rows per driver."""
    out: dict[str, list[dict]] = {name: [] for name in drivers}
    for c in levels:
        parts: dict[str, list] = {name: [] for name in drivers}
        cont: dict[str, list] = {name: [] for name in drivers}
        for k in range(rounds):
            names = list(drivers) if k % 2 == 0 else list(drivers)[::-1]
            for name in names:
                with Contention(server_pgid) as meter:
                    parts[name].append(drivers[name].run(c, duration / rounds))
                cont[name].append(meter.result)
        for name in drivers:
            row = level_row(c, parts[name], cont[name])
            out[name].append(row)
            print(f"  {name} C={c}: {row['steps_per_s']:.2f} steps/s, p50 {row['p50_ms']:.0f} ms, p99 "
                  f"{row['p99_ms']:.0f} ms ({row['steps']} steps, {row['generated_tokens_per_s']:.0f} gen tok/s, "
                  f"cpu client {row['cpu_s']['client']:.1f} s server {row['cpu_s']['server']:.1f} s, "
                  f"other jobs {100 * row['contention']['foreign_cpu_share_max']:.0f}% CPU)", flush=True)
    return out


def warm_runtime(rt: Runtime, args, n: int) -> None:
    for k in range(n):
        system, user = b_prompt(args.seed + 99, 0, k, args.b_system_words, args.b_user_words)
        cid = rt.create_conversation("[warmup] " + system, policy="drop", materialize="never")
        rt.send_message(cid, user, max_tokens=NEW_TOKENS)
        rt.send_message(cid, "again", forced=b_forced(args.seed))
        rt.delete_conversation(cid)


def warm_plain(url: str, tpl, args, n: int) -> None:
    with contextlib.closing(DirectPool(url)) as http:
        for k in range(n):
            system, user = b_prompt(args.seed + 99, 0, k, args.b_system_words, args.b_user_words)
            prompt = tpl.render("[warmup] " + system, [], [Message("user", 0, user)], lambda t: True, True).ids
            generate(http, url, prompt, NEW_TOKENS, sorted(tpl.stop_token_ids))
    flush(url)


# ----- report -------------------------------------------------------------------------


TARGET_LAYER = {"forced": 0.05, "sampled": 0.03}  # our layer's cost over raw /generate on the same server (issue 21)


def targets(b: dict) -> dict:
    """Issue 21's targets, side by side on the session server (the Runtime and raw
    /generate alternated in rounds): our layer within 5% (forced) / 3% (sampled)
    of raw /generate in steps/s and p50 at 1 and 8 agents; 8 agents at least 3x
    the steps/s of 1 (sampled); no command on a step's path."""
    out = {}
    for kind in ("sampled", "forced"):
        ours = {r["concurrency"]: r for r in b["sglang_session_runtime"][kind]}
        raw = {r["concurrency"]: r for r in b.get("sglang_session_raw", {}).get(kind, [])}
        plain = {r["concurrency"]: r for r in b.get("sglang_plain", {}).get(kind, [])}
        entry: dict = {}
        for c in (1, 8):
            if c in ours and c in raw:
                slower = raw[c]["steps_per_s"] / ours[c]["steps_per_s"] - 1
                p50 = ours[c]["p50_ms"] / raw[c]["p50_ms"] - 1
                entry[f"layer_overhead_at_{c}"] = {
                    "steps_per_s_deficit": round(slower, 4), "p50_overhead": round(p50, 4),
                    "target": f"< {TARGET_LAYER[kind]}", "met": max(slower, p50) < TARGET_LAYER[kind],
                    "ours": {"steps_per_s": ours[c]["steps_per_s"], "p50_ms": ours[c]["p50_ms"]},
                    "raw": {"steps_per_s": raw[c]["steps_per_s"], "p50_ms": raw[c]["p50_ms"]}}
        if kind == "sampled" and 1 in ours and 8 in ours:
            sp = ours[8]["steps_per_s"] / ours[1]["steps_per_s"]
            entry["speedup_8_vs_1"] = {"value": round(sp, 3), "target": f">= {TARGET_SPEEDUP}",
                                      "met": sp >= TARGET_SPEEDUP}
        if 8 in ours and 8 in plain:
            entry["p50_at_8_vs_plain_server"] = {
                "value": round(ours[8]["p50_ms"] / plain[8]["p50_ms"] - 1, 4),
                "how": "supplementary: plain SGLang's own server, run minutes apart"}
        burn = {r["concurrency"]: r for r in b.get("sglang_session_raw_burn", {}).get(kind, [])}
        for c in sorted(set(burn) & set(raw)):  # what the burnt CPU alone costs raw /generate (--raw-burn-ms)
            entry[f"raw_burn_at_{c}"] = {"steps_per_s_deficit": round(raw[c]["steps_per_s"] / burn[c]["steps_per_s"] - 1, 4),
                                         "p50_overhead": round(burn[c]["p50_ms"] / raw[c]["p50_ms"] - 1, 4)}
        on_path = [r.get("commands_per_step", {}).get("on_step_path") for r in ours.values()]
        entry["commands_on_step_path_per_step"] = {"values": on_path, "target": "0",
                                                   "met": all(v == 0 for v in on_path if v is not None)}
        out[kind] = entry
    out["note"] = "Booleans only: nothing is asserted. Ratios from one run, alternated in rounds."
    return out


PLOTTED = ("plain", "plain_strip_flag", "session_drop_never", "session_drop_always", "session_strip_emulated")
STYLE = {"plain": ("-o", 3.0), "plain_strip_flag": (":x", 1.5), "session_drop_never": ("--s", 1.5),
         "session_drop_always": ("-^", 1.5), "session_strip_emulated": ("-.d", 1.2)}


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = {k: v for k, v in result["part_a"]["modes"].items() if k in PLOTTED}
    fig, axes = plt.subplots(2, 3, figsize=(20, 10))

    def per_turn(ax, fn, ylabel: str, title: str, log: bool = False) -> None:
        for label, m in modes.items():
            style, width = STYLE[label]
            t = m["turns"]
            ax.plot(range(len(t)), [fn(r) for r in t], style, lw=width, label=label)
        ax.set_xlabel("turn")
        ax.set_ylabel(ylabel)
        ax.set_title(title, fontsize=10)
        if log:
            ax.set_yscale("log")
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.legend(fontsize=8)

    per_turn(axes[0][0], lambda r: r["first_step_prefill"] + r["tool_chain_prefill"],
             "prefill tokens (prompt - cached; forced output excluded)", "(a) prefill tokens per turn")
    per_turn(axes[0][1], lambda r: r["ttft_ms"], "ms (median of repetitions)",
             "(b) TTFT of the turn's first prompt (1-token greedy probe; on CPU it\n"
             "follows context length: SGLang's torch_native attention is O(context^2) per extend)", log=True)
    per_turn(axes[0][2], lambda r: r["orphaned_bytes"] / 2**20, "MiB after the turn",
             "(c) orphaned KV (plain: shadow tree; ours: `pools` evictable)")
    per_turn(axes[1][0], lambda r: r["tool_chain_recomputed"], "tokens",
             "(d) tool-chain recomputed tokens per turn")
    cs = result["settings"]["part_b"]["concurrency"]
    for ax, key, ylabel, title in ((axes[1][1], "steps_per_s", "steps / s", "(e) throughput"),
                                   (axes[1][2], "p50_ms", "p50 step latency, ms", "(f) p50 step latency")):
        for name, rows in result["part_b"]["backends"].items():
            for kind, style in (("sampled", "-o"), ("forced", "--s")):
                r = rows.get(kind) or []
                ax.plot([x["concurrency"] for x in r], [x[key] for x in r], style, label=f"{name} {kind}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(cs, [str(c) for c in cs])
        ax.set_xlabel("concurrent agents")
        ax.set_ylabel(ylabel)
        ax.set_title(f"{title}: {NEW_TOKENS} greedy sampled / {NEW_TOKENS} forced tokens, ~200-token prompts",
                     fontsize=10)
        ax.legend(fontsize=7)
    m = result["machine"]
    fig.suptitle(f"SGLang {result['versions']['sglang']} on {m['cpu']} ({m['cores']} cores, no GPU), model "
                 f"{result['model']['name']} (random weights), page {result['settings']['page_size']}, pool "
                 f"{result['settings']['pool_tokens']} tokens" + (" [--quick]" if result["settings"]["quick"] else ""),
                 fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ----- main -----------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a small run (fewer turns, shorter levels)")
    ap.add_argument("--turns", type=int, default=None, help="Part A turns (default 8, quick 3)")
    ap.add_argument("--scale", type=float, default=None, help="Part A token budgets x (default 1, quick 0.5)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--pool-tokens", type=int, default=262144, help="device KV pool of every server and the embedded engine")
    ap.add_argument("--max-context", type=int, default=32768)
    ap.add_argument("--max-running", type=int, default=32, help="--max-running-requests of every server")
    ap.add_argument("--concurrency", default=None, help="Part B agent counts (default 1,8,32; quick 1,8)")
    ap.add_argument("--duration", type=float, default=None, help="seconds per Part B level and driver (default 14, quick 2)")
    ap.add_argument("--strip-server", choices=["on", "off"], default=None,
                    help="run the --strip-thinking-cache server (Part A mode plain_strip_flag; default on, quick off: "
                         "a server start costs 2-3 minutes here and under forced replay the flag cannot act)")
    ap.add_argument("--reps", type=int, default=None, help="Part A replays per mode (TTFT medians; default 2, quick 1)")
    ap.add_argument("--rounds", type=int, default=None,
                    help="Part B alternations of runtime and raw /generate on the session server (default 2, quick 1)")
    ap.add_argument("--raw-burn-ms", type=float, default=0.0,
                    help="also raw /generate agents that spend this much CPU in Python per step after the answer "
                         "(the runtime client's extra CPU per step, to see what it costs the steps/s)")
    ap.add_argument("--b-system-words", type=int, default=160)
    ap.add_argument("--b-user-words", type=int, default=30)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch/OpenMP threads of every server (OMP_NUM_THREADS) and of the embedded engine; 1 is "
                         "steadiest on a shared 2-core host (0: leave the defaults)")
    ap.add_argument("--model-dir", default=str(Path.home() / ".cache" / "session-runtime" / "models"))
    ap.add_argument("--name", default="sglang", help="results as bench/results/NAME.json and NAME.png")
    ap.add_argument("--skip", default="", help="comma-separated: plain, plain_strip, session, embedded, part_a, part_b (debugging)")
    args = ap.parse_args()
    os.chdir(_HERE.parent)  # the servers run `python -m sglang...` from the cwd: never from bench/
    args.turns = args.turns or (3 if args.quick else 8)
    args.scale = args.scale or (0.5 if args.quick else 1.0)
    args.duration = args.duration or (2.0 if args.quick else 14.0)
    args.reps = args.reps or (1 if args.quick else 2)
    args.rounds = args.rounds or (1 if args.quick else 2)
    args.strip_server = args.strip_server or ("off" if args.quick else "on")
    calls = (1, 2) if args.quick else (2, 4)
    system_words = 300 if args.quick else 1000
    args.concurrency = args.concurrency or ("1,8" if args.quick else "1,8,32")
    levels = [int(c) for c in args.concurrency.split(",")]
    skip = set(filter(None, args.skip.split(",")))

    import sglang
    import torch

    from session_runtime.model.export import export_preset

    load0 = os.getloadavg()
    import subprocess

    git = {k: subprocess.run(cmd, capture_output=True, text=True, cwd=_HERE.parent).stdout.strip()
           for k, cmd in (("commit", ["git", "rev-parse", "HEAD"]), ("status", ["git", "status", "--porcelain"]))}
    if args.threads > 0:
        os.environ["OMP_NUM_THREADS"] = str(args.threads)  # inherited by every server the bench launches
        torch.set_num_threads(args.threads)  # the embedded engine runs in this process
    tokenizer = load_tokenizer("tiny")
    tpl = build_template("deepseek", tokenizer)
    folder = export_preset("tiny", args.seed, Path(args.model_dir), min_vocab=tokenizer.vocab_size)
    bpt = kv_bytes_per_token(folder)
    trace = make_trace(tpl, args.seed, args.turns, args.scale, calls, system_words)
    ps = args.page_size
    modes: dict[str, dict] = {}
    backends: dict[str, dict] = {}
    servers: dict[str, dict] = {}
    log_dir = Path(os.environ.get("TMPDIR", "/tmp")) / f"sglang-bench-{os.getpid()}"
    log_dir.mkdir(parents=True, exist_ok=True)

    def started(name: str, server: LaunchedServer, t0: float) -> None:
        servers[name] = {"argv": server.spec.argv(int(server.url.rsplit(":", 1)[1]))[1:], "url": server.url,
                         "start_s": round(server.started_s, 1), "log": server.log_path}
        print(f"[{name}] server up in {server.started_s:.0f} s ({time.perf_counter() - t0:.0f} s incl. launch) "
              f"at {server.url}", flush=True)

    def part_a_plain(name: str, label: str, url: str, pgid: int) -> None:
        reps, cont = [], []
        for k in range(args.reps):
            flush(url)
            with Contention(pgid) as meter:
                reps.append(play_plain(f"{label}#{k}", url, trace, tpl, ps, bpt))
            cont.append(meter.result)
        modes[label] = summarize_mode(reps)
        modes[label]["contention"] = cont

    # 1. plain SGLang: Part A `plain`, Part B (ii)
    if "plain" not in skip:
        t0 = time.perf_counter()
        server = launch(spec_for(args, folder, log=str(log_dir / "plain.log")), ready)
        try:
            started("plain", server, t0)
            info = httpx.get(f"{server.url}/server_info", timeout=30).json()
            servers["plain"]["radix_cache_backend"] = info.get("radix_cache_backend")
            warm_plain(server.url, tpl, args, 2)
            if "part_a" not in skip:
                print("[plain] Part A", flush=True)
                part_a_plain("plain", "plain", server.url, server.process.pid)
                flush(server.url)
                warm_plain(server.url, tpl, args, 2)
            print("[plain] Part B", flush=True)
            for kind in ("sampled", "forced") if "part_b" not in skip else ():
                rows = part_b({"sglang_plain": RawAgents(server.url, tpl, args, kind, "plain")}, levels,
                              args.duration, args.rounds, server.process.pid)
                backends.setdefault("sglang_plain", {})[kind] = rows["sglang_plain"]
        finally:
            server.stop()

    # 2. plain SGLang with --strip-thinking-cache: Part A `plain_strip_flag`
    if "plain_strip" not in skip and "part_a" not in skip and args.strip_server == "on":
        t0 = time.perf_counter()
        server = launch(spec_for(args, folder, extra=("--strip-thinking-cache",), log=str(log_dir / "strip.log")),
                        ready)
        try:
            started("plain_strip", server, t0)
            warm_plain(server.url, tpl, args, 2)
            print("[plain_strip] Part A", flush=True)
            part_a_plain("plain_strip", "plain_strip_flag", server.url, server.process.pid)
        finally:
            server.stop()

    # 3. SGLang with our backend through the Runtime: Part A session_*, Part B (iii)
    if "session" not in skip:
        t0 = time.perf_counter()
        rt = Runtime(RuntimeConfig(model=str(folder), backend="sglang", page_size=ps, pool_tokens=args.pool_tokens,
                                   max_context=args.max_context, template="deepseek", data_dir=None, offload="never",
                                   seed=args.seed, sglang_max_running=args.max_running), background=True)
        try:
            server = rt.backend.server
            started("session", server, t0)
            servers["session"]["describe"] = rt.backend.describe()
            servers["session"]["radix_cache_backend"] = httpx.get(f"{server.url}/server_info",
                                                                  timeout=30).json().get("radix_cache_backend")
            warm_runtime(rt, args, 2)
            labels = [label for label, (where, _) in MODES.items() if where == "session"]
            reps: dict[str, list] = {label: [] for label in labels}
            cont: dict[str, list] = {label: [] for label in labels}
            for k in range(args.reps if "part_a" not in skip else 0):  # round robin over the modes, so load from other jobs hits them alike
                for label in labels[k % len(labels):] + labels[: k % len(labels)]:
                    flush(server.url)
                    print(f"[session] Part A {label}#{k}", flush=True)
                    with Contention(server.process.pid) as meter:
                        reps[label].append(play_runtime(f"{label}#{k}", rt, trace, MODES[label][1], tpl, ps, bpt))
                    cont[label].append(meter.result)
            for label in labels if "part_a" not in skip else ():
                modes[label] = summarize_mode(reps[label])
                modes[label]["contention"] = cont[label]
            flush(server.url)
            warm_runtime(rt, args, 2)
            print("[session] Part B", flush=True)
            for kind in ("sampled", "forced") if "part_b" not in skip else ():
                rows = part_b({"sglang_session_runtime": RuntimeAgents(rt, args, kind, "session"),
                               "sglang_session_raw": RawAgents(server.url, tpl, args, kind, "raw"),
                               **({"sglang_session_raw_burn": RawAgents(server.url, tpl, args, kind, "burn",
                                                                        args.raw_burn_ms)}
                                  if args.raw_burn_ms > 0 else {})},
                              levels, args.duration, args.rounds, server.process.pid)
                for name, r in rows.items():
                    backends.setdefault(name, {})[kind] = r
            rt.check_integrity()
        finally:
            rt.close()

    # 4. the embedded engine in this process: Part B (i)
    if "embedded" not in skip and "part_b" not in skip:
        t0 = time.perf_counter()
        rt = Runtime(RuntimeConfig(model=str(folder), backend="embedded", page_size=ps, pool_tokens=args.pool_tokens,
                                   host_pool_tokens=0, max_context=args.max_context, template="deepseek",
                                   data_dir=None, offload="never", seed=args.seed), background=True)
        try:
            print(f"[embedded] runtime up in {time.perf_counter() - t0:.1f} s (torch threads "
                  f"{torch.get_num_threads()})", flush=True)
            warm_runtime(rt, args, 2)
            print("[embedded] Part B", flush=True)
            for kind in ("sampled", "forced"):
                rows = part_b({"embedded": RuntimeAgents(rt, args, kind, "embedded")}, levels, args.duration,
                              1, None)
                backends.setdefault("embedded", {})[kind] = rows["embedded"]
            rt.check_integrity()
        finally:
            rt.close()

    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), platform.machine()) if Path("/proc/cpuinfo").exists() else platform.machine()
    summary = {label: modes[label] for label in MODES if label in modes}
    sizes = [s for t in trace["turns"] for s in t["sizes"]]
    result = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": {"cpu": cpu, "cores": os.cpu_count(), "memory_gib": round(os.sysconf("SC_PAGE_SIZE") *
                    os.sysconf("SC_PHYS_PAGES") / 2**30, 1), "gpu": None, "python": platform.python_version(),
                    "client_torch_threads": torch.get_num_threads()},
        "versions": {"sglang": sglang.__version__, "torch": torch.__version__, "git_commit": git["commit"],
                     "git_dirty": git["status"].splitlines()},
        "model": {"name": "tiny", "folder": str(folder), "weights": f"random, seed {args.seed}",
                  "config": json.loads((folder / "config.json").read_text()), "dtype": "float32",
                  "kv_bytes_per_token": bpt, "tokenizer": tokenizer.name, "template": "deepseek"},
        "settings": {"quick": args.quick, "page_size": ps, "pool_tokens": args.pool_tokens,
                     "max_context": args.max_context, "max_running_requests": args.max_running, "seed": args.seed,
                     "strip_server": args.strip_server, "skip": sorted(skip),
                     "threads": {"servers_OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
                                 "embedded_torch_threads": torch.get_num_threads()},
                     "part_a": {"turns": args.turns, "scale": args.scale, "repetitions": args.reps, "tool_calls_per_turn": list(calls),
                                "system_words": system_words, "reasoning_over_answer": [5, 20],
                                "answer_tokens_range": [round(20 * args.scale), round(50 * args.scale)]},
                     "part_b": {"concurrency": levels, "duration_s_per_level": args.duration, "rounds": args.rounds,
                                "new_tokens": NEW_TOKENS, "temperature": 0.0,
                                "system_words": args.b_system_words, "user_words": args.b_user_words,
                                "policy": "drop", "materialize": "never"}},
        "servers": servers,
        "what_ran_where": {
            "plain": "SGLang server, default radix cache (no --radix-cache-backend), raw /generate client in this process",
            "plain_strip_flag": "SGLang server with --strip-thinking-cache, same raw client",
            "session_*": "SGLang server with --radix-cache-backend session, driven by session_runtime.Runtime "
                         "(backend='sglang') in this process; commands ride /generate requests (kv_hints)",
            "embedded": "session_runtime.Runtime(backend='embedded') in this process (our decoder over SGLang's pools)",
            "common_server_flags": "--skip-tokenizer-init --device cpu --dtype float32 --sleep-on-idle "
                                   "--enable-priority-scheduling (SESSION_RUNTIME_SGLANG_CPU=1)",
        },
        "part_a": {"modes": summary, "trace_sizes": [t["sizes"] for t in trace["turns"]],
                   "reasoning_over_answer": {"min": min(s["ratio"] for s in sizes), "max": max(s["ratio"] for s in sizes)},
                   "forced_tokens_total": sum(s["reasoning_tokens"] + s["answer_tokens"] + 2 for s in sizes)},
        "part_b": {"backends": backends,
                   "targets": targets(backends) if "sglang_session_runtime" in backends else None},
        "notes": NOTES,
        "wall_s": round(time.perf_counter() - _T0, 1),
        "loadavg": {"start": list(load0), "end": list(os.getloadavg())},
    }
    write_report(args.name, result, plot)
    print()
    for label, m in summary.items():
        tt = m["totals"]
        print(f"{label:<24} prefill {tt['prefill_tokens']:>7,} (first {tt['first_step_prefill']:>6,} tool "
              f"{tt['tool_chain_prefill']:>6,} idle {tt['idle_prefill_tokens']:>6,})  tool recomputed "
              f"{tt['tool_chain_recomputed']:>6,}  next-turn ttft {m['next_turn_ttft_median_ms']:7.1f} ms  "
              f"final orphaned {m['final_orphaned_bytes'] / 2**20:6.2f} MiB")
    if result["part_b"]["targets"]:
        print(json.dumps(result["part_b"]["targets"], indent=1))
    print(f"wall {result['wall_s']:.0f} s -> {RESULTS}/{args.name}.json, {args.name}.png")


NOTES = {
    "prompts": "Every Part A mode renders identical prompts: a client-side copy of the runtime's rendering "
               "(ClientConversation: StepPath.run/_commit/TurnClose.close under policy drop; the deepseek template "
               "writes `</think>` and only the answer for closed turns, the open turn's tool chain replays its "
               "generated ids). For our backend it is checked against the Runtime: its own render of each first "
               "prompt equals it token for token, and every step's prompt length and recomputed history agree "
               "(`checks.prompts_equal`).",
    "forced_output": "Forced output (replay) is the template's ids for {reasoning, content, tool_calls}; plain SGLang "
                     "gets prompt + forced ids as input_ids with max_new_tokens=0, exactly as the runtime's SGLang "
                     "backend sends a forced step. Forced tokens are always computed; they are excluded from "
                     "`prefill tokens` (prompt tokens minus cached_tokens, the prompt being everything before the "
                     "forced output) and are the same in every mode (`forced_tokens`).",
    "ttft": "Next-turn TTFT = time to the first streamed token of a greedy 1-token sampled request on the turn's "
            "first prompt, sent just before the forced first step (the forced-step latency is recorded too, as "
            "`forced_first_step_ms`). Plain: measured by the raw client; ours: the SGLang backend's ttft_ms, which "
            "travels in the step's own hints (no separate round trip). The probe computes only the prompt "
            "(its one token is never fed), so the tree gains the prompt's full pages, a prefix of the forced step "
            "that follows: no orphan. Its cached_tokens are the first step's cached tokens (`first_cached_tokens`). "
            "The Runtime's own accounting of first steps (cache_state, counterfactual) sees the probe's pages, so "
            "`cache_state_reported` says generated_branch where the runtime alone would say prefix_only; the bench "
            "uses none of it. Per-turn TTFTs are medians over `repetitions` replays (round robin over the session "
            "modes; the tree is flushed before each replay).",
    "tool_chain_recomputed": "Per tool step: max(0, tokens before the new tool results - cached tokens): the "
                             "runtime's recomputed_history_tokens; the client computes the same for plain SGLang. "
                             "What is left is the previous step's last partial page (< page size): SGLang caches "
                             "whole pages only.",
    "orphaned": "KV the tree still caches that no chain holds and no future prompt of this conversation can reuse, "
                "measured after each turn (after the canonical branch is built, for drop+always). Plain SGLang "
                "(both servers): a token-level shadow of what each request inserted (its computed tokens cut to "
                "whole pages), minus the page-aligned match of the next canonical history; the pool is far larger "
                "than the workload, so nothing is evicted, and each request's predicted cached_tokens is checked "
                "against the server's (`shadow_mismatches` lists any difference). Ours under drop: the `pools` "
                "command's evictable tokens (one conversation on the server at a time; the tree is flushed "
                "between replays), cross-checked against tree tokens minus a probe of the next canonical prompt "
                "(`checks.evictable_equals_stale`). session_strip_emulated holds no chain: its figure is tree minus "
                "reusable. Bytes = tokens x kv_bytes_per_token.",
    "strip_flag": "SGLang 0.5.23's --strip-thinking-cache frees a finished request's output only when the request "
                  "counted reasoning tokens (Req.owned_kv_len: `strip_thinking_cache and reasoning_tokens > 0`). "
                  "Reasoning tokens are counted on *generated* tokens against think-end ids, which need "
                  "--reasoning-parser and a tokenizer in the scheduler (none under --skip-tokenizer-init). Under "
                  "forced replay the output is input, so the flag cannot act, and plain_strip_flag equals plain "
                  "token for token. It would need the forced tokens to be decoded one by one (a custom logit "
                  "processor) with a reasoning parser and the scheduler's tokenizer: not done here.",
    "strip_emulated": "Supplementary mode: the runtime's own per-request emulation of the flag's semantics on our "
                      "backend (policy strip_thinking_cache: kv_hints cache_limit = the step's prompt length, no "
                      "chain), i.e. what --strip-thinking-cache would do if the output were generated: each step "
                      "caches only its prompt, so tool steps recompute the previous steps' output. (Before commit "
                      "8c23380 the hint said cache_output=false and the session cache cut at len(origin_input_ids), "
                      "which includes forced output, so forced output was cached anyway.)",
    "memory_pressure": "Part A runs without memory pressure (pool >> workload): plain SGLang then keeps everything "
                       "and its reuse equals drop+never's. What differs: nothing of plain SGLang's is locked (LRU "
                       "may evict the live prefix under load while the orphaned branches stay), drop+always moves "
                       "the answer's prefill to idle time, and the orphaned KV each mode leaves.",
    "part_b": "Each step opens a fresh conversation (system ~160 one-token words + a ~30-word user message: ~210 "
              "prompt tokens, all prefilled) and runs its first turn: sampled = up to 32 greedy new tokens (stop: "
              "the template's eos, as the runtime sends; the raw client sends the same stop ids; generated tokens/s "
              "and the number of steps short of 32 are reported), forced = 32 forced tokens (22 reasoning + "
              "</think> + 8 content + eos). Conversations (policy drop, materialize never) are deleted after each "
              "run, outside the timed window. C threads, one agent each; a step's latency is one send_message "
              "(Runtime) or one streamed /generate (raw: the body the backend sends minus session_id, kv_hints "
              "and namespace keys). Steps in flight at the deadline finish and count; steps/s = steps / (last "
              "finish - start). On the session server the Runtime and raw /generate alternate in `rounds` per "
              "level (sglang_session_raw: the session layer's cost alone, under the same load); plain SGLang's "
              "server runs on its own, minutes apart. The embedded engine runs one step at a time, so its latency "
              "at C > 1 is queueing. Our layer per step adds template rendering; the step is one /generate whose "
              "kv_hints carry the counterfactual probes and whose meta_info brings back the tree's report; the "
              "turn's close (hold the fork, free the branch, mark idle) is one command request sent after the step "
              "has answered (`commands_per_step`: on_step_path, after_step, lease_renewals, counted from the "
              "backend's own counters).",
    "contention": "This 2-core machine is shared: other jobs (e.g. test suites that start their own SGLang servers) "
                  "may run meanwhile. Every measurement records `contention`: CPU seconds the machine was busy "
                  "minus this process's and the measured server's process group's, over wall x cores "
                  "(foreign_cpu_share), and the 1-minute load average. Treat rows with a high share as noisy.",
    "cpu": "No GPU: servers, client and embedded engine share the CPU cores (servers run one at a time; the "
           "embedded engine runs after every server stopped). Every server runs with OMP_NUM_THREADS=--threads "
           "(default 1) and the embedded engine with as many torch threads: with 2 threads on 2 cores shared with "
           "other jobs, a server spent about twice the CPU per step (OpenMP threads waiting for each other). "
           "SGLang runs torch-native attention on our "
           "out-of-tree CPU platform; a server start costs 2-3 minutes here (~200 CPU-seconds). Absolute numbers "
           "are CPU numbers; ratios are the point.",
    "quick": "--quick: 3 turns at half scale, 1-2 tool calls per turn, 1 replay per mode, 2 s per Part B level and "
             "driver, 1 round, 1 and 8 agents only, and no --strip-thinking-cache server (--strip-server on to run "
             "it): two server starts already take about 6 of its 8 minutes here.",
}


if __name__ == "__main__":
    main()
