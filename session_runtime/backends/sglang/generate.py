"""One step on SGLang's server as the wire carries it (backend.py sends it):
the checks before it, the `/generate` body out, the streamed chunks in, and
the step's result and accounting from its last chunk's `meta_info` and the
tree's report in it. Pure functions: no connection, no state."""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass
from typing import Optional, Sequence

import orjson

from radix_ext.sglang.hints import ChainIntent
from radix_ext.sglang.report import report_of
from radix_ext.tree import ProbeResult
from session_runtime.accounting import StepAccounting, attention_work
from session_runtime.backends.base import ChainState, StepRequest, StepResult, StepTiming
from session_runtime.constrained.grammar import whole_tag
from session_runtime.errors import ContextTooLong, InvalidRequest, PoolExhausted
from session_runtime.turns import common_prefix

logger = logging.getLogger(__name__)

USER_PRIORITY = 1  # with --enable-priority-scheduling a higher value runs first
BACKGROUND_PRIORITY = 0


def check_prompt(prompt: list[int], forced: Optional[list[int]], max_context: int, vocab_size: int, capacity: int) -> None:
    """Refuse a step SGLang could never run: empty, past the context, out of the
    vocabulary, or larger than the pool (what does not fit yet, it queues)."""
    n = len(prompt)
    if n == 0:
        raise InvalidRequest("the prompt is empty")
    extra = len(forced or ())
    if n + extra >= max_context:
        raise ContextTooLong(f"prompt of {n} tokens (plus {extra} forced) does not fit the context "
                             f"limit of {max_context}")
    ids = prompt + (forced or [])
    if max(ids) >= vocab_size or min(ids) < 0:
        raise InvalidRequest(f"token id out of the model's vocabulary (0..{vocab_size - 1})")
    # SGLang queues what does not fit yet; what can never fit is refused here.
    if n + extra > capacity:
        raise PoolExhausted(f"the step needs {n + extra} KV slots; the server's pool holds {capacity}")


def request_body(req: StepRequest, prompt: list[int], forced: Optional[list[int]], intent: ChainIntent,
                 max_context: int) -> dict:
    """The `/generate` body of a step: its ids (forced output appended, with no
    new tokens), sampling, grammar, namespace, priority, and `intent` (what the
    tree does for the step) in `kv_hints`."""
    sp = req.sampling
    params: dict = {"temperature": sp.temperature, "top_p": sp.top_p, "stop_token_ids": sorted(sp.stop_token_ids)}
    if sp.top_k:
        params["top_k"] = sp.top_k
    if sp.seed is not None:
        params["sampling_seed"] = sp.seed % 2**31
    if sp.stop:  # matched by SGLang in the decoded output, as our engine matches them
        params["stop"] = list(sp.stop)
    tag = whole_tag(sp.grammar, sp.think_end, sp.think_budget, sorted(sp.stop_token_ids))
    if tag is not None:  # compiled by the server's grammar backend (xgrammar), reasoning block included
        params["structural_tag"] = tag
    body: dict = {
        "input_ids": prompt if forced is None else prompt + forced,
        "sampling_params": params, "stream": True, "session_id": req.owner,
        "kv_hints": intent.envelope(uuid.uuid4().hex),
        "priority": BACKGROUND_PRIORITY if req.background else USER_PRIORITY,
    }
    if req.namespace.extra_key is not None:
        body["extra_key"] = req.namespace.extra_key
    if req.namespace.cache_salt is not None:
        body["cache_salt"] = req.namespace.cache_salt
    if forced is None:
        params["max_new_tokens"] = min(sp.max_tokens, max_context - len(prompt))
        body["return_logprob"] = sp.logprobs
    else:
        params["max_new_tokens"] = 0
        if sp.logprobs and forced:
            # Logprobs of the forced tokens: SGLang gives input position i the
            # logprob of token i given 0..i-1, and none for the first position.
            body["return_logprob"] = True
            body["logprob_start_len"] = len(prompt) - 1
    return body


@dataclass(frozen=True)
class Timings:
    """perf_counter readings of a step: sent, its first and last output, its end."""

    start: float
    first: Optional[float]
    last: Optional[float]
    end: float


def step_result(req: StepRequest, prompt: list[int], forced: Optional[list[int]], meta: dict, output: list[int],
                riding: Sequence, timings: Timings, page_size: int, bytes_per_token: int) -> tuple[StepResult, dict]:
    """The step's result from its last chunk's `meta_info` and the output ids
    streamed, with its accounting (the prefix SGLang matched, host tokens
    promoted) and the tree's report (returned too: what it probed, promoted
    and holds now)."""
    t = Timings(timings.start, timings.first or timings.end, timings.last, timings.end)
    n = len(prompt)
    reason = meta.get("finish_reason") or {}
    stop_sequence = None
    if forced is not None:
        output, finish = forced, "forced"
        computed = prompt + forced
        for tok in forced if req.on_token else ():
            req.on_token(tok)
        logprobs = forced_logprobs(meta, len(forced)) if req.sampling.logprobs else None
    else:
        finish = "stop" if reason.get("type") == "stop" else "length"
        matched = reason.get("matched")
        stop_sequence = matched if finish == "stop" and isinstance(matched, str) else None
        computed = prompt + output[:-1] if output else prompt
        logprobs = [e[0] for e in meta.get("output_token_logprobs") or []] if req.sampling.logprobs else None
    report = report_of(meta) or {}
    if report.get("error"):
        logger.error("the tree's pre-actions for a step of %s failed: %s", req.owner, report["error"])
    for (name, _), got in zip(riding, report.get("before") or ()):
        if not got.get("ok"):
            logger.warning("the %s that rode a step of %s failed: %s", name, req.owner, got.get("error"))
    logical = int(report.get("logical_len", 0))
    cached = min(int(meta.get("cached_tokens") or 0), n)
    promoted = report.get("promoted") or {}
    anchor, count = int(promoted.get("anchor", 0)), int(promoted.get("tokens", 0))
    host_loaded = min(count, max(0, cached - anchor))  # promoted tokens this request reused
    cached -= host_loaded
    ps = page_size
    upto = len(computed) if req.cache_output else n
    # The chain keeps its partial last page privately; the tree alone, whole pages.
    inserted = upto if req.hold_chain else upto // ps * ps
    total_ms = (t.end - t.start) * 1e3
    accounting = StepAccounting(
        prompt_tokens=n, cached_input_tokens=cached, host_loaded_tokens=host_loaded,
        uncached_prefill_tokens=n - cached - host_loaded,
        logical_reusable_tokens=max(logical, cached + host_loaded),
        alignment_loss_tokens=max(0, logical - cached - host_loaded),
        recomputed_history_tokens=max(0, min(req.history_len, n) - cached - host_loaded),
        active_context_length=len(computed), output_tokens=len(output),
        kv_device_bytes=inserted * bytes_per_token, kv_host_bytes=0,
        # SGLang does not report its prefill time per request: the first
        # token as this client sees it bounds it from above.
        prefill_ms=(t.first - t.start) * 1e3, ttft_ms=(t.first - t.start) * 1e3,
        tpot_ms=((t.last - t.first) / (len(output) - 1) * 1e3) if forced is None and len(output) > 1 and t.last else 0.0,
        attention_work=attention_work(n - cached - host_loaded, cached + host_loaded),
    )
    probes = [ProbeResult(logical_len=p[0], device_len=p[1]) for p in report.get("probes") or ()]
    # A streamed sampled step's report left with its first chunk: the chain then
    # holds the step's whole computed sequence (radix_ext/sglang/report.py).
    held = report.get("chain_tokens", len(computed) if req.hold_chain else None)
    chain = None if held is None or not report else ChainState(
        tokens=int(held), host_bytes=int(report.get("host_bytes", 0)),
        free_fraction=float(report.get("free_fraction", 1.0)))
    return StepResult(output=output, finish_reason=finish, stop_sequence=stop_sequence, sequence=computed,
                      logprobs=logprobs,
                      accounting=accounting, timing=StepTiming(total_ms, total_ms, 0.0),
                      probes=probes if len(probes) == len(req.probe_prompts) else None, chain=chain), report


def sse_chunks(lines):
    """The JSON objects of SGLang's `/generate` stream (`data: {...}` lines, as
    bytes, up to `data: [DONE]`)."""
    for line in lines:
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            for _ in lines:  # read to the stream's end: a response closed unread closes its
                pass  # connection, and the next request would open one (connect, and the server's accept)
            return
        yield orjson.loads(data)


def relative(probe: Sequence[int], prompt: list[int]) -> tuple[int, list[int]]:
    """A probe prompt as (tokens it shares with the step's prompt, the rest)."""
    shared = common_prefix(probe, prompt)
    return shared, list(probe[shared:])


def forced_logprobs(meta: dict, count: int) -> list[float]:
    entries = meta.get("input_token_logprobs") or []
    values = [e[0] for e in entries[1:]]
    assert len(values) == count, f"SGLang returned {len(values)} input logprobs for {count} forced tokens"
    return values
