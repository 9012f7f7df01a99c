"""The runtime's Python API: conversations over the embedded engine.

    rt = Runtime(RuntimeConfig(model="tiny"))
    cid = rt.create_conversation(system="You are terse.")
    step = rt.send_message(cid, "Hello", max_tokens=8)

The HTTP layer and the examples call only this class.
"""

from __future__ import annotations

import threading
import uuid
from typing import Optional, Sequence

from radix_ext.tree import Namespace, NodeInfo
from session_runtime.config import RuntimeConfig
from session_runtime.conversation import Conversation, Step, TraceEntry
from session_runtime.engine import Engine, StepRequest
from session_runtime.errors import ConversationNotFound, InvalidRequest
from session_runtime.model.weights import build_decoder
from session_runtime.sampling import SamplingParams
from session_runtime.template import DeepSeekTemplate, Message
from session_runtime.tokenizer import load_tokenizer


class Runtime:
    """Holds conversations and the engine. Thread-safe."""

    def __init__(self, config: Optional[RuntimeConfig] = None):
        self.config = config or RuntimeConfig()
        self.tokenizer = load_tokenizer(self.config.model)
        decoder = build_decoder(self.config.model, self.config.seed, self.config.torch_dtype, self.config.device)
        if self.tokenizer.vocab_size > decoder.cfg.vocab_size:
            raise InvalidRequest(
                f"tokenizer has {self.tokenizer.vocab_size} ids, the model only {decoder.cfg.vocab_size}"
            )
        self.engine = Engine(self.config, decoder)
        self.engine.warmup()
        self.template = DeepSeekTemplate(self.tokenizer)
        self.model_id = self.config.model_id or self.config.model
        self.conversations: dict[str, Conversation] = {}
        self._lock = threading.RLock()

    # ----- conversations ------------------------------------------------------

    def namespace(self, conv: Conversation) -> Namespace:
        """Cache namespace: model, tokenizer and template; the tenant as salt."""
        return Namespace(
            extra_key=f"{self.model_id}|{self.tokenizer.digest}|{self.template.name}",
            cache_salt=conv.tenant,
        )

    def create_conversation(self, system: Optional[str] = None, tenant: Optional[str] = None) -> str:
        """Create an empty conversation; returns its id."""
        if system is not None and not isinstance(system, str):
            raise InvalidRequest("system must be a string")
        conv = Conversation(id=uuid.uuid4().hex[:16], system=system or None, tenant=tenant or None)
        with self._lock:
            self.conversations[conv.id] = conv
        return conv.id

    def get(self, conversation_id: str) -> Conversation:
        """Raises ConversationNotFound."""
        with self._lock:
            conv = self.conversations.get(conversation_id)
        if conv is None:
            raise ConversationNotFound(conversation_id)
        return conv

    def delete_conversation(self, conversation_id: str) -> None:
        """Forget the conversation and unlock its chain (its KV becomes evictable)."""
        with self._lock:
            conv = self.get(conversation_id)
            del self.conversations[conv.id]
            self.engine.release(conv.id)

    def send_message(
        self,
        conversation_id: str,
        content: str,
        *,
        max_tokens: int = 64,
        temperature: float = 0.0,
        seed: Optional[int] = None,
        logprobs: bool = False,
        forced: Optional[dict] = None,
    ) -> Step:
        """Open a turn with a user message and run one step.

        `forced` = {"reasoning": str, "content": str} appends that output instead of
        sampling. Raises ConversationNotFound, InvalidRequest (empty message, bad
        options), ContextTooLong or PoolExhausted; on error nothing changes.
        """
        if not isinstance(content, str) or not content.strip():
            raise InvalidRequest("message content must be a non-empty string")
        sampling = SamplingParams(
            max_tokens=max_tokens, temperature=temperature, seed=seed,
            stop_token_ids=self.template.stop_token_ids, logprobs=logprobs,
        )
        forced_ids = self._forced_ids(forced)
        with self.engine.lock:
            conv = self.get(conversation_id)
            user = Message(role="user", content=content)
            history = self.template.render(conv.system, conv.history, generation_prompt=False)
            rendered = self.template.render(conv.system, [*conv.history, user], generation_prompt=True)
            result = self.engine.step(
                StepRequest(
                    owner=conv.id, prompt=rendered.ids, namespace=self.namespace(conv),
                    sampling=sampling, forced=forced_ids, history_len=len(history.ids) if conv.turns else 0,
                )
            )
            # Commit to the conversation only now: the step succeeded.
            parsed = self.template.parse_output(result.output)
            reasoning = self.tokenizer.decode(parsed.reasoning_ids)
            answer = self.tokenizer.decode(parsed.content_ids)
            turn = conv.turn_count
            conv.history += [user, Message("assistant", answer, reasoning, tuple(result.output))]
            conv.trace += [
                TraceEntry(turn, "user", content),
                TraceEntry(turn, "assistant", answer, reasoning, result.finish_reason),
            ]
            conv.turns.append([result.accounting])
            conv.chain_tokens = result.sequence
        return Step(
            conversation_id=conv.id, turn=turn, step=0, reasoning=reasoning, content=answer,
            finish_reason=result.finish_reason, output_ids=result.output,
            logprobs=result.logprobs, accounting=result.accounting,
        )

    def _forced_ids(self, forced: Optional[dict]) -> Optional[list[int]]:
        if forced is None:
            return None
        if not isinstance(forced, dict) or set(forced) - {"reasoning", "content"}:
            raise InvalidRequest("forced must be {reasoning?, content?}")
        reasoning, content = forced.get("reasoning", ""), forced.get("content", "")
        if not isinstance(reasoning, str) or not isinstance(content, str):
            raise InvalidRequest("forced reasoning and content must be strings")
        return self.template.forced_ids(reasoning, content)

    # ----- inspection ---------------------------------------------------------

    def describe(self, conversation_id: str, tokens: bool = False) -> dict:
        """Trace, canonical history, per-turn accounting and the chain."""
        conv = self.get(conversation_id)
        with self.engine.lock:
            chain_len = self.engine.tree.chain_tokens(conv.id)
            out = {
                "id": conv.id,
                "system": conv.system,
                "tenant": conv.tenant,
                "trace": [e.__dict__ for e in conv.trace],
                "history": [{"role": m.role, "content": m.content, "reasoning": m.reasoning} for m in conv.history],
                "turns": [[a.as_dict() for a in t] for t in conv.turns],
                "chain": {
                    "sequence_tokens": len(conv.chain_tokens),
                    "cached_tokens": chain_len,
                    "kv_device_bytes": chain_len * self.engine.bytes_per_token,
                },
            }
            if tokens:
                out["chain"]["token_ids"] = list(conv.chain_tokens)
        return out

    def tree_snapshot(self, conversation: Optional[str] = None) -> list[NodeInfo]:
        if conversation is not None:
            self.get(conversation)
        with self.engine.lock:
            return self.engine.tree.snapshot(preview=self._preview, owner=conversation)

    def chains(self) -> dict[str, int]:
        """Tokens each conversation's chain holds in the tree."""
        with self.engine.lock:
            return {cid: self.engine.tree.chain_tokens(cid) for cid in self.conversations}

    def gauges(self) -> dict[str, float]:
        """Pool usage for /metrics."""
        with self.engine.lock:
            tree, pools = self.engine.tree, self.engine.pools
            return {
                "pool_capacity_tokens": pools.capacity,
                "pool_free_tokens": pools.allocator.available_size(),
                "tree_locked_tokens": tree.protected_size(),
                "tree_evictable_tokens": tree.evictable_size(),
                "conversations": len(self.conversations),
            }

    def _preview(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids)

    def check_integrity(self) -> None:
        with self.engine.lock:
            self.engine.check_integrity()
            for cid in self.engine.tree.chains:
                assert cid in self.conversations, f"chain {cid} has no conversation"
