"""The embedded engine's side of constrained output: a token mask per step from
the step's structural tag (xgrammar), and the watch for stop sequences.

`Guards(tokenizer)` is built once per engine; `for_step(sampling, vocab)` gives
a step its `Guard`, whose `mask(logits)` leaves only the tokens the grammar
admits, `accept(token)` moves the grammar on, and `stop_matched(output)` names
the stop sequence the output now ends on. The grammar's state lives in the
Guard, which lives for one step: nothing of it reaches the next.
"""

from __future__ import annotations

import threading
from typing import Optional, Sequence

import torch

from session_runtime.errors import InvalidRequest
from session_runtime.sampling import SamplingParams


_SHIFTS = torch.arange(32, dtype=torch.int32)  # a bitmask word's bits, lowest first (xgrammar's order)


class Guards:
    """xgrammar compilers for one tokenizer, per vocabulary width and stop
    tokens, built on first use (about a second: the vocabulary is indexed);
    compiled grammars are cached by the compiler."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._lock = threading.Lock()
        self._compilers: dict[tuple[int, frozenset[int]], object] = {}

    def compiler(self, vocab: int, stops: frozenset[int]):
        import xgrammar as xgr
        from transformers import PreTrainedTokenizerFast

        with self._lock:
            key = (vocab, stops)
            if key not in self._compilers:
                hf = PreTrainedTokenizerFast(tokenizer_object=self.tokenizer.inner)
                info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab, stop_token_ids=sorted(stops))
                self._compilers[key] = xgr.GrammarCompiler(info, max_threads=1)
            return self._compilers[key]

    def compile(self, grammar: str, vocab: int, stops: frozenset[int], field: str = "response_format"):
        """The compiled structural tag. Raises InvalidRequest naming `field`
        for a grammar xgrammar cannot compile (a schema it does not support)."""
        try:
            return self.compiler(vocab, stops).compile_structural_tag(grammar)
        except (RuntimeError, ValueError) as exc:
            raise InvalidRequest(f"{field}: the schema cannot be compiled into a grammar: {exc}", param=field) from None

    def for_step(self, sampling: SamplingParams, vocab: int) -> Optional["Guard"]:
        if not sampling.constrained:
            return None
        compiled = self.compile(sampling.grammar, vocab, sampling.stop_token_ids) if sampling.grammar else None
        return Guard(compiled, vocab, sampling.stop, self.tokenizer, sampling)


class Guard:
    """One step's constraint. While the output is inside the reasoning block
    (`sampling.think_end` set) the Guard itself keeps the stop tokens out and
    brings the end token at the budget; the grammar (xgrammar) starts after
    it. xgrammar could follow the block too (`any_tokens` with a budget, as
    SGLang does with `grammar.whole_tag`), but a grammar whose later parts hold
    free text (`any_text`, `tag`) takes about 0.2 s a token there (xgrammar
    0.2.7, a 129k vocabulary; our grammars avoid those now), and the mask of
    a free region costs a step's time for nothing."""

    def __init__(self, compiled, vocab: int, stops: Sequence[str], tokenizer,
                 sampling: SamplingParams = SamplingParams()):
        self.matcher = self.bitmask = None
        if compiled is not None:
            import xgrammar as xgr

            self.matcher = xgr.GrammarMatcher(compiled)
            self.bitmask = xgr.allocate_token_bitmask(1, vocab)
        self.refused = 0  # tokens the mask admitted and the grammar refused (accept)
        self.think_end = sampling.think_end  # None once the reasoning block has ended
        self.think_left = sampling.think_budget
        self.stop_ids = sorted(i for i in sampling.stop_token_ids if 0 <= i < vocab)
        self.vocab = vocab
        self.stops = tuple(stops)
        self.tokenizer = tokenizer
        # A stop sequence of n characters lies within the last 4n + 2 tokens (a
        # character is at most four byte tokens; one more may end mid-character).
        self.window = 4 * max((len(s) for s in self.stops), default=0) + 2

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits` ([vocab]) with every token the grammar does not admit next at -inf (a copy)."""
        if self.think_end is not None:  # inside the reasoning block: no stop token; at the budget its end
            masked = logits.clone()
            if self.think_left is not None and self.think_left <= 0:
                end = masked[self.think_end].clone()
                masked.fill_(float("-inf"))
                masked[self.think_end] = end if torch.isfinite(end) else 0.0
            elif self.stop_ids:
                masked[self.stop_ids] = float("-inf")
            return masked
        if self.matcher is None:
            return logits
        import xgrammar as xgr

        self.matcher.fill_next_token_bitmask(self.bitmask)
        if logits.is_cuda:  # xgrammar's kernel on the device
            masked = logits.detach().float().clone().unsqueeze(0)
            xgr.apply_token_bitmask_inplace(masked, self.bitmask.to(logits.device, non_blocking=True),
                                            vocab_size=self.vocab)
            return masked[0]
        # On the CPU the bits unpacked by torch: a third of xgrammar's CPU apply (0.15 ms against 0.5 at 129k).
        allowed = ((self.bitmask[0].unsqueeze(1) >> _SHIFTS) & 1).flatten().bool()
        if allowed.shape[0] < logits.shape[0]:
            allowed = torch.cat((allowed, allowed.new_zeros(logits.shape[0] - allowed.shape[0])))
        return logits.float().masked_fill(~allowed[: logits.shape[0]], float("-inf"))

    def accept(self, token: int) -> bool:
        """Move on past `token`; False (and nothing moved) when the grammar
        refuses it although its mask admitted it: xgrammar 0.2.7's mask admits
        now and then a token that runs through the end of a free-text region
        (`any_text` with excludes), which accepting it then refuses. The
        caller draws again without it."""
        if self.think_end is not None:
            if token == self.think_end:
                self.think_end = None  # the grammar starts with the next token
            elif self.think_left is not None:
                self.think_left -= 1
            return True
        if self.matcher is not None and not self.matcher.accept_token(token):
            self.refused += 1
            return False
        return True

    def stop_matched(self, output: Sequence[int]) -> Optional[str]:
        """The stop sequence the output's newest text completes, if any."""
        if not self.stops:
            return None
        tail = self.tokenizer.decode(list(output[-self.window:]))
        return next((s for s in self.stops if s in tail), None)
