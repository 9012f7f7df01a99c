"""What the runtime checks in a request before anything changes or is
tokenized whole: text, sizes against the context, the tenant's stored bytes,
sampling parameters. A mixin of Runtime (`runtime.py`), which has the config,
tokenizer, backend and the tenants' byte counts these read."""

from __future__ import annotations

from typing import Optional

from session_runtime.constrained.spec import NONE as NO_CONSTRAINT, OutputConstraint
from session_runtime.errors import ContextTooLong, InvalidRequest, TenantStorageFull
from session_runtime.sampling import SamplingParams
from session_runtime.tools import check_tools


class RequestChecks:
    """Mixin of Runtime: the checks of a request."""

    def _check_budget(self, tenant: Optional[str]) -> None:
        """Raises TenantStorageFull when the tenant holds its budget of stored bytes."""
        limit = self.config.max_tenant_bytes
        with self._lock:
            held = self._tenant_bytes.get(tenant, 0)
        if limit and held >= limit:
            raise TenantStorageFull(f"the tenant's conversations hold {held} bytes, the most this server keeps "
                                    f"for one ({limit}, --max-tenant-bytes): delete some first")

    def _check_prompt(self, system: object, tools: object) -> list[dict]:
        """A conversation's system prompt and tools, checked before anything is
        tokenized or kept; returns the tools as a list. Raises InvalidRequest,
        ContextTooLong."""
        if system is not None and not isinstance(system, str):
            raise InvalidRequest("system must be a string")
        _utf8("system", system or "")
        tools, text = check_tools(tools, self.config.max_tools, self.config.max_tools_bytes)
        self._fits("system", system or "")
        self._fits("tools", text)
        return tools

    def _check_message(self, content: object) -> None:
        """Refuse a user message before taking any lock. Raises InvalidRequest, ContextTooLong."""
        if not isinstance(content, str) or not content.strip():
            raise InvalidRequest("message content must be a non-empty string")
        _utf8("content", content)
        self._fits("content", content)

    @property
    def context_limit(self) -> int:
        """The longest sequence a step may reach (an SGLang server's may be shorter than ours)."""
        return min(self.config.max_context, getattr(self.backend, "max_context", self.config.max_context))

    @property
    def max_tokens_limit(self) -> int:
        """The most tokens a step may generate: --max-tokens-limit, never more
        than the context."""
        context = self.context_limit
        return min(self.config.max_tokens_limit or context, context)

    def max_tokens(self, requested: Optional[int], default: Optional[int] = 64) -> int:
        """A request's max_tokens: `default` (at most the limit) when None, and
        with `default` None the limit itself (the step then clamps it to what
        remains of the context, as SGLang and vLLM budget a request without a
        cap). A cap above the context is clamped to it; one above an operator's
        --max-tokens-limit is refused (InvalidRequest), as is a non-integer."""
        limit = self.max_tokens_limit
        if requested is None:
            return limit if default is None else min(default, limit)
        if not isinstance(requested, int) or isinstance(requested, bool) or requested < 0:
            raise InvalidRequest(f"max_tokens must be an integer >= 0, got {requested!r}", param="max_tokens")
        if self.config.max_tokens_limit is not None and requested > limit:
            raise InvalidRequest(f"max_tokens {requested} is over this server's limit of {limit} "
                                 "(--max-tokens-limit)", param="max_tokens")
        return min(requested, limit)

    def _fits(self, name: str, text: str) -> None:
        """Refuse (413) text too long for the context before tokenizing it whole:
        more bytes than any tokenization of the context covers is refused at
        once, and a text of fewer bytes as soon as about a context's worth of
        it has more tokens than the context (a few milliseconds), so a huge
        input costs no tokenizer time or memory."""
        limit = self.config.max_context
        if self.tokenizer.surely_more_tokens_than(text, limit):
            raise ContextTooLong(f"{name} of {len(text.encode('utf-8'))} bytes has more tokens than the context of "
                                 f"{limit}; it was not tokenized whole")

    def _sampling(self, conv, max_tokens, temperature, seed, logprobs, top_p: float = 1.0,
                  top_logprobs: int = 0, constraint: OutputConstraint = NO_CONSTRAINT, top_k: int = 0) -> SamplingParams:
        if top_logprobs and not self.backend.supports_top_logprobs:
            raise InvalidRequest(f"top_logprobs is not supported on the {self.backend.name} backend yet",
                                 param="top_logprobs")
        return SamplingParams(
            max_tokens=self.max_tokens(max_tokens), temperature=temperature, seed=seed, top_p=top_p, top_k=top_k,
            top_logprobs=top_logprobs,
            stop_token_ids=self.template(conv.template).stop_token_ids, logprobs=logprobs, stop=constraint.stop,
        )



def _utf8(*named: str) -> None:
    """Raise InvalidRequest for text that is not valid Unicode (a lone surrogate
    from a JSON escape): it could not be tokenized, stored or returned."""
    for name, text in zip(named[::2], named[1::2]):
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise InvalidRequest(f"{name} is not valid Unicode: {exc.reason} at {exc.start}") from None
