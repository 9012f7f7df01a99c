"""Oracle: greedy tokens and logprobs through the SGLang backend (SGLang's
real server with our `session` tree) equal transformers' in float32, cold and
with a cached prefix; forced output's logprobs equal teacher-forced ones."""

from __future__ import annotations

import pytest
import torch

from radix_ext.tree import Namespace
from session_runtime.backends.base import StepRequest
from session_runtime.sampling import SamplingParams

NEW = 8


@pytest.fixture(scope="module")
def hf(tiny_hf_folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_hf_folder, torch_dtype=torch.float32,
                                                attn_implementation="eager").eval()


def _greedy(hf, prompt: list[int], new: int) -> tuple[list[int], list[float]]:
    ids = torch.tensor([prompt])
    tokens, logprobs = [], []
    with torch.no_grad():
        for _ in range(new):
            logits = hf(ids).logits[0, -1]
            tok = int(torch.argmax(logits))
            tokens.append(tok)
            logprobs.append(float(torch.log_softmax(logits, -1)[tok]))
            ids = torch.cat((ids, torch.tensor([[tok]])), dim=1)
    return tokens, logprobs


def _forced_logprobs(hf, prompt: list[int], forced: list[int]) -> list[float]:
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + forced])).logits[0]
    lp = torch.log_softmax(logits, -1)
    return [float(lp[len(prompt) - 1 + i, tok]) for i, tok in enumerate(forced)]


def _step(backend, owner: str, prompt: list[int], ns: Namespace, forced=None):
    return backend.step(StepRequest(owner=owner, prompt=prompt, namespace=ns, forced=forced,
                                    sampling=SamplingParams(max_tokens=NEW, logprobs=True)))


def test_greedy_equals_transformers_cold_and_with_a_cached_prefix(sglang_runtime, hf):
    backend = sglang_runtime.backend
    ns = Namespace(extra_key="oracle-greedy")
    gen = torch.Generator().manual_seed(5)
    shared = torch.randint(1000, 120000, (37,), generator=gen).tolist()
    first = shared + [11, 12, 13]
    second = shared + [21, 22, 23, 24, 25]
    try:
        cold = _step(backend, "oracle-a", first, ns)
        assert cold.accounting.cached_input_tokens == 0
        warm = _step(backend, "oracle-b", second, ns)
        # The first request's chain holds its prompt: 32 of the 37 shared tokens
        # are whole pages (page 16).
        assert warm.accounting.cached_input_tokens == 32
        for result, prompt in ((cold, first), (warm, second)):
            tokens, logprobs = _greedy(hf, prompt, NEW)
            assert result.output == tokens
            assert result.logprobs == pytest.approx(logprobs, abs=2e-3)
    finally:
        backend.release("oracle-a")
        backend.release("oracle-b")
    sglang_runtime.check_integrity()


def test_forced_output_logprobs_equal_teacher_forcing(sglang_runtime, hf):
    backend = sglang_runtime.backend
    ns = Namespace(extra_key="oracle-forced")
    prompt = list(range(2000, 2035))
    forced = [7001, 7002, 7003, 7004, 7005, 7006]
    try:
        result = _step(backend, "oracle-f", prompt, ns, forced=forced)
        assert result.output == forced and result.finish_reason == "forced"
        assert result.logprobs == pytest.approx(_forced_logprobs(hf, prompt, forced), abs=2e-3)
        # The forced tokens were prefilled as output: the chain holds them all
        # (two pages in the tree, the partial last page private).
        assert backend.chain_tokens("oracle-f") == len(prompt) + len(forced)
    finally:
        backend.release("oracle-f")
