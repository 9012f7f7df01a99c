"""UpstreamBackend: a provider's API (DeepSeek, an OpenAI-compatible server,
OpenAI Responses, Anthropic, Gemini) answers each step of a conversation.

No KV lives here, so nothing is probed, held or offloaded: the tree methods
answer "empty". A step takes the conversation's trace (every reasoning block,
the provider's continuation state), builds that protocol's request, sends it
through the one outbound stripper, and records the answer as the template's
ids, so the conversation's layers (trace, canonical history, protocol state)
stay what they are on the local backends. Accounting holds the provider's
usage (`cached_input_tokens` as the provider reports it, None when it does not)
and what the stripper did.
"""

from __future__ import annotations

import json
import time
from typing import Callable, Iterator, Optional, Sequence

from radix_ext.tree import NodeInfo
from session_runtime.accounting import StepAccounting
from session_runtime.backends.base import Backend, HoldsNoChain, StepRequest, StepResult, StepTiming, WireReply
from session_runtime.errors import InvalidRequest, UpstreamUnavailable
from session_runtime.metrics import Sample
from session_runtime.protocols.base import CHAT_PROTOCOLS, StripOptions, passthrough_from_env
from session_runtime.protocols.canonical import Usage
from session_runtime.proxy.client import UpstreamClient
from session_runtime.proxy.outbound import Forwarded, Outbound, StripAccount
from session_runtime.proxy.transcript import reply_parts, request_body


class UpstreamBackend(HoldsNoChain, Backend):
    name = "upstream"
    supports_offload = False
    holds_kv = False
    wants_transcript = True
    bytes_per_token = 0
    capacity = 0

    def __init__(self, config, tokenizer):
        self.config = config
        self.page_size = config.page_size
        self.max_context = config.max_context
        self.client = UpstreamClient(config.upstream_url, config.upstream_protocol, config.upstream_key,
                                     config.upstream_timeout_s)
        options = StripOptions(passthrough=config.reasoning_passthrough or passthrough_from_env(),
                               keep_tool_turns=config.keep_tool_turn_reasoning,
                               context=config.upstream_reasoning_context)
        self.outbound = Outbound(self.client, tokenizer.count, options,
                                 model=config.upstream_model)
        self._steps_ok = 0
        self._steps_failed = 0

    # ----- a step ----------------------------------------------------------------

    def step(self, req: StepRequest) -> StepResult:
        if req.transcript is None:
            raise InvalidRequest("the upstream backend answers conversation steps only")
        if req.forced is not None:
            raise InvalidRequest("forced output is not supported in upstream mode: the provider answers")
        t = req.transcript
        s = req.sampling
        params = {"model": self.config.upstream_model or self.config.model_id or self.config.model,
                  "max_tokens": s.max_tokens, "temperature": s.temperature}
        if s.top_p < 1.0:
            params["top_p"] = s.top_p
        if s.seed is not None and self.config.upstream_protocol != "anthropic":
            params["seed"] = s.seed
        if s.top_k and self.config.upstream_protocol in ("anthropic", "gemini"):
            params["top_k"] = s.top_k
        for name, text in self.config.upstream_params:  # last: they win; null leaves the field out
            value = json.loads(text)
            if value is None:
                params.pop(name, None)
            else:
                params[name] = value
        body = request_body(self.config.upstream_protocol, t.system, t.tools, t.messages, params, t.prefix)
        if req.cancel is not None:
            req.cancel.check()
        t0 = time.perf_counter()
        try:
            sent = self.outbound.send(body, t.prefix)
        except Exception:
            self._steps_failed += 1
            raise
        parts = reply_parts(self.config.upstream_protocol, sent.body, sent.reply)
        output = list(t.template.forced_ids(parts.reasoning, parts.content, parts.calls))
        if req.on_token is not None:  # the whole answer at once: the provider was not streamed
            for tok in output:
                req.on_token(tok)
        usage = sent.reply.usage or Usage(len(req.prompt), len(output))
        elapsed = (time.perf_counter() - t0) * 1e3
        upstream = self._record(sent, usage, model=params["model"])
        acc = _accounting(usage, elapsed, len(req.prompt) + len(output), upstream)
        self._steps_ok += 1
        wire = WireReply(parts.reasoning, parts.content, parts.calls, parts.wire, upstream)
        return StepResult(output=output, finish_reason=parts.finish_reason, sequence=[*req.prompt, *output],
                          logprobs=None, accounting=acc, timing=StepTiming(elapsed, elapsed, 0.0), wire=wire)

    # ----- a stateless chat completion (the client holds the transcript) ------------

    def forward_chat(self, body: dict) -> tuple[Forwarded, dict, StepAccounting]:
        """A chat completion body as the client sent it, stripped and sent; returns
        what was forwarded, the provider's answer plus `accounting.upstream`, and
        the request's accounting (for the metrics)."""
        self._check_chat()
        forwarded = self.outbound.send(body)
        self._steps_ok += 1
        usage = forwarded.reply.usage
        upstream = self._record(forwarded, usage)
        acc = _accounting(usage or Usage(0, 0), forwarded.elapsed_ms, 0, None)
        return forwarded, {**forwarded.body, "accounting": {"upstream": upstream}}, acc

    def forward_stream(self, body: dict) -> tuple[int, Iterator[bytes], StripAccount]:
        """The streamed form: (the provider's status, its SSE bytes as they come,
        what the stripper did). A refusal raises before any byte is sent."""
        self._check_chat()
        sent, account = self.outbound.prepare(body)
        stream = self.client.stream(sent)
        status, chunks = stream.__enter__()
        if status >= 400:
            raw = b"".join(chunks)
            stream.__exit__(None, None, None)
            try:
                error = json.loads(raw)
            except ValueError:
                error = raw.decode("utf-8", "replace")
            self._steps_failed += 1
            if status >= 500:  # as a plain request's: the provider failed, nothing changed, retry it
                raise UpstreamUnavailable(f"the upstream {self.client.url} failed with {status}",
                                          details={"status": status, "body": error, "stripper": account.as_dict()})
            raise self.outbound.refused(status, error, account)
        self._steps_ok += 1

        def relay() -> Iterator[bytes]:
            try:
                yield from chunks
            finally:
                stream.__exit__(None, None, None)

        return status, relay(), account

    def _check_chat(self) -> None:
        """A chat completion is forwarded as it came: only to a chat upstream. Raises InvalidRequest."""
        if self.config.upstream_protocol not in CHAT_PROTOCOLS:
            raise InvalidRequest(f"a chat completion without conversation_id is forwarded as it is, so it needs a "
                                 f"chat upstream ({', '.join(CHAT_PROTOCOLS)}), not {self.config.upstream_protocol}: "
                                 "give a conversation_id, and the conversation speaks the upstream's protocol")

    def _record(self, sent: Forwarded, usage: Optional[Usage], **extra) -> dict:
        """`accounting.upstream`: the provider's usage (None when it gave none) and what the stripper did."""
        return {"protocol": self.config.upstream_protocol, **extra, "id": sent.reply.id,
                "usage": None if usage is None else {
                    "prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
                    "cached_input_tokens": usage.cached_input_tokens, "reasoning_tokens": usage.reasoning_tokens},
                "stripper": sent.strip.as_dict(), "elapsed_ms": round(sent.elapsed_ms, 2)}

    # ----- no KV here --------------------------------------------------------------

    def snapshot(self, preview: Callable[[Sequence[int]], str], owner: Optional[str] = None) -> list[NodeInfo]:
        return []

    def metric_samples(self) -> list[Sample]:
        return [Sample("upstream_steps_total", self._steps_ok, help="Steps the upstream answered", kind="counter"),
                Sample("upstream_step_failures_total", self._steps_failed,
                       help="Steps the upstream refused or could not answer", kind="counter")]

    def free_fraction(self) -> float:
        return 1.0

    def check_integrity(self) -> None:
        pass

    def describe(self) -> str:
        return f"upstream {self.config.upstream_protocol} at {self.client.base_url}"

    def close(self) -> None:
        self.client.close()


def _accounting(usage: Usage, elapsed_ms: float, context: int, upstream: Optional[dict]) -> StepAccounting:
    """A step's accounting from the provider's usage: no KV lives here, so the
    local figures are 0; cached and prefilled tokens are None where the provider
    does not say."""
    cached = usage.cached_input_tokens
    return StepAccounting(
        prompt_tokens=usage.prompt_tokens, cached_input_tokens=cached, host_loaded_tokens=0,
        uncached_prefill_tokens=None if cached is None else usage.prompt_tokens - cached,
        logical_reusable_tokens=0, alignment_loss_tokens=0, recomputed_history_tokens=0,
        active_context_length=context, output_tokens=usage.completion_tokens, kv_device_bytes=0, kv_host_bytes=0,
        prefill_ms=0.0, ttft_ms=elapsed_ms, tpot_ms=0.0, attention_work=0, upstream=upstream)
