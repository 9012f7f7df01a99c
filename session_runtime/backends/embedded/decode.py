"""A step's output on the embedded engine, after its prefill: the forced
tokens appended in one forward (with their logprobs where asked), or tokens
sampled one at a time under the step's grammar (constrained/matcher.py) until
a stop token, a stop sequence or the limit. The engine (engine.py) owns the
pools and the forwards; this owns the loop over them."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from session_runtime.backends.base import Cancellation, StepRequest
from session_runtime.constrained.matcher import Guard
from session_runtime.sampling import Sampler, token_logprob, top_logprobs

# Tokens a step's grammar may refuse after its mask admitted them (Guard.accept)
# before the step fails: a few in a step are xgrammar's, more a bug of ours.
_MAX_REFUSED = 32

# forward(ids, start, all_logits, cancel): the logits of `ids` fed at positions start..
Forward = Callable[..., torch.Tensor]


@dataclass
class Decoded:
    """What the step produced after its prefill."""

    output: list[int]
    computed: list[int]  # the tokens whose KV the step computed: the prompt and output fed
    finish: str
    first_token_t: float
    decode_end_t: float
    model_s: float
    stop_sequence: Optional[str] = None
    logprobs: list[float] = field(default_factory=list)
    tops: list[list[tuple[int, float]]] = field(default_factory=list)  # top_logprobs alternatives per token
    logits: list[torch.Tensor] = field(default_factory=list)  # kept where the request asks for them


def decode(req: StepRequest, prompt: list[int], logits: torch.Tensor, forward: Forward,
           pass_turn: Callable[[Optional[Cancellation]], None], sync: Callable[[], None], limit: int,
           guard: Optional[Guard] = None) -> Decoded:
    """The output after a prefill whose logits are `logits` (the last row, or
    every row with `req.return_logits`); `limit`: the most tokens to sample."""
    if req.forced is not None:
        return _forced(req, prompt, logits, forward, sync)
    return _sampled(req, prompt, logits[-1], forward, pass_turn, sync, limit, guard)


def _forced(req: StepRequest, prompt: list[int], logits: torch.Tensor, forward: Forward,
            sync: Callable[[], None]) -> Decoded:
    sp = req.sampling
    forced = list(req.forced)
    want_all = req.return_logits or sp.logprobs
    logprobs, tops, kept = [], [], []
    t = time.perf_counter()
    if forced:
        more = forward(forced, len(prompt), want_all, req.cancel)
        if want_all:
            rows = torch.cat((logits[-1:], more[:-1]))
            if sp.logprobs:
                logprobs = [token_logprob(rows[i], tok) for i, tok in enumerate(forced)]
            if sp.top_logprobs:
                tops = [top_logprobs(rows[i], sp.top_logprobs) for i in range(len(forced))]
            if req.return_logits:
                kept.append(more)
    sync()
    end = time.perf_counter()
    for tok in forced if req.on_token else ():
        req.on_token(tok)
    return Decoded(forced, prompt + forced, "forced", t, end, end - t, None, logprobs, tops, kept)


def _sampled(req: StepRequest, prompt: list[int], last: torch.Tensor, forward: Forward,
             pass_turn: Callable[[Optional[Cancellation]], None], sync: Callable[[], None], limit: int,
             guard: Optional[Guard]) -> Decoded:
    sp = req.sampling
    sampler = Sampler(sp)
    n = len(prompt)
    output: list[int] = []
    logprobs, tops, kept = [], [], []
    stop_sequence = None
    first_token_t = None
    t = time.perf_counter()
    finish = "length"
    while len(output) < limit:
        if guard is not None:
            last = guard.mask(last)
        tok = sampler.sample(last)
        while guard is not None and not guard.accept(tok):  # admitted, then refused: drawn again without it
            if guard.refused > _MAX_REFUSED:
                raise RuntimeError(f"the grammar refused {guard.refused} tokens its mask admitted")
            last = last.clone()
            last[tok] = float("-inf")
            tok = sampler.sample(last)
        if sp.logprobs:
            logprobs.append(token_logprob(last, tok))
        if sp.top_logprobs:
            tops.append(top_logprobs(last, sp.top_logprobs))
        output.append(tok)
        if req.on_token is not None:
            req.on_token(tok)
        if first_token_t is None:
            first_token_t = time.perf_counter()
        if tok in sp.stop_token_ids:
            finish = "stop"
            break
        stop_sequence = guard.stop_matched(output) if guard is not None else None
        if stop_sequence is not None:
            finish = "stop"
            break
        if len(output) == limit:
            break
        pass_turn(req.cancel)
        out = forward([tok], n + len(output) - 1, False)
        last = out[-1]
        if req.return_logits:
            kept.append(out)
    sync()
    end = time.perf_counter()
    # The last sampled token was never fed, so it has no KV yet.
    computed = prompt + output[:-1] if output else prompt
    return Decoded(output, computed, finish, first_token_t or end, end, end - t, stop_sequence, logprobs, tops, kept)
