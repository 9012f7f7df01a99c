"""What the runtime checks in a request before anything changes or is
tokenized whole: text, sizes against the context, the tenant's stored bytes,
sampling parameters, a turn's new messages (a user message, tool results
answering every pending call) and forced output. The runtime's part for it
(core.py builds it with the config, tokenizer, backend, its templates and
the tenants' stored bytes); it changes nothing."""

from __future__ import annotations

from typing import Callable, Optional, Sequence

from session_runtime.constrained.spec import NONE as NO_CONSTRAINT, OutputConstraint
from session_runtime.errors import ContextTooLong, ConversationBusy, InvalidRequest, TenantStorageFull, ToolCallConflict
from session_runtime.sampling import SamplingParams
from session_runtime.templates import Message, Template, ToolCall
from session_runtime.tools import check_tools


class RequestChecks:
    """`template(name)`: the runtime's template of that name; `held(tenant)`:
    the bytes the tenant's conversations hold as stored."""

    def __init__(self, config, tokenizer, backend, template: Callable[[str], Template],
                 held: Callable[[Optional[str]], int]):
        self.config, self.tokenizer, self.backend = config, tokenizer, backend
        self.template, self.held = template, held

    def budget(self, tenant: Optional[str]) -> None:
        """Raises TenantStorageFull when the tenant holds its budget of stored bytes."""
        limit = self.config.max_tenant_bytes
        held = self.held(tenant)
        if limit and held >= limit:
            raise TenantStorageFull(f"the tenant's conversations hold {held} bytes, the most this server keeps "
                                    f"for one ({limit}, --max-tenant-bytes): delete some first")

    def prompt(self, system: object, tools: object) -> list[dict]:
        """A conversation's system prompt and tools, checked before anything is
        tokenized or kept; returns the tools as a list. Raises InvalidRequest,
        ContextTooLong."""
        if system is not None and not isinstance(system, str):
            raise InvalidRequest("system must be a string")
        _utf8("system", system or "")
        tools, text = check_tools(tools, self.config.max_tools, self.config.max_tools_bytes)
        self.fits("system", system or "")
        self.fits("tools", text)
        return tools

    def message(self, content: object) -> None:
        """Refuse a user message before taking any lock. Raises InvalidRequest, ContextTooLong."""
        if not isinstance(content, str) or not content.strip():
            raise InvalidRequest("message content must be a non-empty string")
        _utf8("content", content)
        self.fits("content", content)

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

    def fits(self, name: str, text: str) -> None:
        """Refuse (413) text too long for the context before tokenizing it whole:
        more bytes than any tokenization of the context covers is refused at
        once, and a text of fewer bytes as soon as about a context's worth of
        it has more tokens than the context (a few milliseconds), so a huge
        input costs no tokenizer time or memory."""
        limit = self.config.max_context
        if self.tokenizer.surely_more_tokens_than(text, limit):
            raise ContextTooLong(f"{name} of {len(text.encode('utf-8'))} bytes has more tokens than the context of "
                                 f"{limit}; it was not tokenized whole")

    def sampling(self, conv, max_tokens, temperature, seed, logprobs, top_p: float = 1.0,
                  top_logprobs: int = 0, constraint: OutputConstraint = NO_CONSTRAINT, top_k: int = 0) -> SamplingParams:
        if top_logprobs and not self.backend.supports_top_logprobs:
            raise InvalidRequest(f"top_logprobs is not supported on the {self.backend.name} backend yet",
                                 param="top_logprobs")
        return SamplingParams(
            max_tokens=self.max_tokens(max_tokens), temperature=temperature, seed=seed, top_p=top_p, top_k=top_k,
            top_logprobs=top_logprobs,
            stop_token_ids=self.template(conv.template).stop_token_ids, logprobs=logprobs, stop=constraint.stop,
        )

    def user_message(self, conv, content: str) -> list[Message]:
        """The user message that opens the conversation's next turn. Raises
        ConversationBusy while tool calls are pending."""
        if conv.protocol is not None:
            pending = [c.id for c in conv.protocol.pending_calls]
            raise ConversationBusy(f"turn {conv.protocol.turn} waits for tool results: {pending}; answer them "
                                   "first")
        return [Message("user", len(conv.turns), content)]

    def result_messages(self, conv, results: Sequence[dict]) -> list[Message]:
        """The tool messages answering every pending call, in the calls' order.
        Raises ToolCallConflict (none pending, unknown or repeated id),
        InvalidRequest (a call left unanswered, bad results), ContextTooLong."""
        if conv.protocol is None:
            raise ToolCallConflict("no tool call is pending in this conversation")
        by_id = {}
        for r in results:
            if not isinstance(r, dict) or not isinstance(r.get("tool_call_id"), str) or not isinstance(r.get("content", ""), str):
                raise InvalidRequest("each result must be {tool_call_id: str, content: str}")
            _utf8("tool result", r.get("content", ""))
            self.fits("tool result", r.get("content", ""))
            by_id.setdefault(r["tool_call_id"], []).append(r.get("content", ""))
        pending = {c.id: c for c in conv.protocol.pending_calls}
        unknown = [i for i in by_id if i not in pending]
        repeated = [i for i, v in by_id.items() if len(v) > 1]
        if unknown or repeated:
            raise ToolCallConflict(f"unknown or already answered tool calls: {unknown + repeated}")
        missing = [i for i in pending if i not in by_id]
        if missing:
            raise InvalidRequest(f"results must answer every pending call; missing {missing}")
        turn = conv.protocol.turn
        return [Message("tool", turn, content=by_id[c.id][0], tool_call_id=c.id) for c in conv.protocol.pending_calls]

    def forced_ids(self, tpl: Template, forced: Optional[dict]) -> Optional[list[int]]:
        """The ids of `forced` output ({reasoning?, content?, tool_calls?}, replay's) as
        `tpl` writes them. Raises InvalidRequest for what it cannot write back."""
        if forced is None:
            return None
        if not isinstance(forced, dict) or set(forced) - {"reasoning", "content", "tool_calls"}:
            raise InvalidRequest("forced must be {reasoning?, content?, tool_calls?}")
        reasoning, content = forced.get("reasoning") or "", forced.get("content") or ""
        if not isinstance(reasoning, str) or not isinstance(content, str):
            raise InvalidRequest("forced reasoning and content must be strings")
        _utf8("forced reasoning", reasoning, "forced content", content)
        calls = []
        for c in forced.get("tool_calls") or ():
            if not isinstance(c, dict) or not isinstance(c.get("name"), str) or not isinstance(c.get("arguments", {}), dict):
                raise InvalidRequest("forced tool_calls must be [{name: str, arguments: object}]")
            calls.append(ToolCall(id="", name=c["name"], arguments=c.get("arguments", {})))
        ids = tpl.forced_ids(reasoning, content, calls)
        # Replay appends exactly what the template writes: refuse what it cannot
        # write back (a reasoning holding the end-of-thinking marker, a tool name
        # that breaks the call markup, ...), rather than store something else.
        back = tpl.parse_output(ids, "")
        if (back.reasoning.strip(), back.content.strip()) != (reasoning.strip(), content.strip()) or [
            (c.name, c.arguments) for c in back.tool_calls
        ] != [(c.name, c.arguments) for c in calls]:
            raise InvalidRequest("forced output does not survive the chat template: it would read back as "
                                 f"reasoning {back.reasoning[:60]!r}, content {back.content[:60]!r}, "
                                 f"{len(back.tool_calls)} tool calls")
        return ids



def _utf8(*named: str) -> None:
    """Raise InvalidRequest for text that is not valid Unicode (a lone surrogate
    from a JSON escape): it could not be tokenized, stored or returned."""
    for name, text in zip(named[::2], named[1::2]):
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise InvalidRequest(f"{name} is not valid Unicode: {exc.reason} at {exc.start}") from None
