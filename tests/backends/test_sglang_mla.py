"""DeepSeek's MLA end to end on the SGLang backend, on this CPU: a
DeepSeek-V3-architecture folder (random weights, dense layers, yarn rope)
served by SGLang's real server with our `session` tree, its latent pool and
the CPU platform's MLA attention (`radix_ext/sglang/mla_attention.py`).

- the oracle: greedy tokens and logprobs equal transformers' DeepseekV3 in
  float32, cold, with a cached prefix, after a host-tier reload and on the
  canonical branch;
- part of the conformance suite and the zero-waste tests run here unchanged
  (chains, exact turn-2 reuse, tool chain, canonical branch, private page,
  fork-page copy, tool-wait offload and the shared host tier);
- a hundred turns that drop their reasoning inside pages leave the pool's
  free pages where they started.

One server start for the module."""

from __future__ import annotations

import pytest
import torch

from radix_ext.tree import Namespace
from session_runtime.backends.base import StepRequest
from session_runtime.sampling import SamplingParams
from tests.api.conftest import start_server
# Run here unchanged: they take `backend_live` / `sglang_runtime` / `hf`, overridden below.
from tests.api.test_backends import (  # noqa: F401
    client, test_canonical_branch_in_idle_time, test_chat_completions_continue_the_chain,
    test_keep_policy_reuses_the_whole_generated_turn, test_tool_chain_continuation_and_turn_two_reuse,
)
from tests.backends import mla_folder
from tests.backends.test_sglang_oracle import (  # noqa: F401
    _greedy, test_forced_output_logprobs_equal_teacher_forcing,
    test_greedy_equals_transformers_cold_and_with_a_cached_prefix,
)
from tests.backends.test_sglang_zero_waste import (  # noqa: F401
    test_a_prefix_on_the_scheduler_host_tier_is_shared_not_prefilled_again, test_canonical_branch_orders,
    test_fork_copy_frees_the_branch_and_is_exact, test_own_continuation_reuses_the_private_page,
    test_tool_wait_offload_in_the_scheduler_is_exact,
)
from tests.conftest import _folder_runtime

NEW = 8


@pytest.fixture(scope="module")
def mla_hf_folder(tmp_path_factory):
    return mla_folder.write_folder(tmp_path_factory.mktemp("tiny-deepseek-v3"))


@pytest.fixture(scope="module")
def sglang_runtime(mla_hf_folder):
    rt = _folder_runtime(mla_hf_folder, "sglang")
    yield rt
    rt.close()


@pytest.fixture(scope="module")
def hf(mla_hf_folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(mla_hf_folder, dtype=torch.float32,
                                                attn_implementation="eager").eval()


@pytest.fixture(scope="module")
def backend_live(sglang_runtime):
    live = start_server(sglang_runtime)
    yield live
    live.stop()


def _pages_free(backend) -> int:
    p = backend.pools()
    return p["available"] + p["evictable"]


def test_the_pool_is_the_latent_one(sglang_runtime):
    """One latent per token and layer (kv_lora_rank + qk_rope_head_dim, float32),
    not a K and a V."""
    backend = sglang_runtime.backend
    assert backend.bytes_per_token == mla_folder.SHAPE["num_hidden_layers"] * mla_folder.latent_width() * 4


def test_greedy_equals_transformers_after_a_host_reload(sglang_runtime, hf):
    """A chain demoted to the scheduler's host tier and promoted by the next
    request decodes what transformers decodes."""
    backend = sglang_runtime.backend
    ns = Namespace(extra_key="mla-reload")
    gen = torch.Generator().manual_seed(9)
    prompt = torch.randint(1000, 120000, (45,), generator=gen).tolist()
    try:
        first = backend.step(StepRequest(owner="mla-r", prompt=prompt, namespace=ns,
                                         sampling=SamplingParams(max_tokens=NEW, logprobs=True)))
        moved = backend.demote("mla-r")
        assert moved > 0 and backend.host_bytes("mla-r") == moved * backend.bytes_per_token
        second_prompt = prompt + first.output + [31, 32, 33]
        second = backend.step(StepRequest(owner="mla-r", prompt=second_prompt, namespace=ns,
                                          sampling=SamplingParams(max_tokens=NEW, logprobs=True)))
        assert second.accounting.host_loaded_tokens == moved
        tokens, logprobs = _greedy(hf, second_prompt, NEW)
        assert second.output == tokens
        assert second.logprobs == pytest.approx(logprobs, abs=2e-3)
    finally:
        backend.release("mla-r")
    sglang_runtime.check_integrity()


def test_greedy_equals_transformers_on_the_canonical_branch(sglang_rt, hf):
    """After a turn that drops its reasoning, the canonical branch is prefilled
    in idle time; the next turn reuses it and decodes what transformers
    decodes on the same ids."""
    rt = sglang_rt
    cid = rt.create_conversation(system="Latent attention, canonical branch. " * 4, policy="drop",
                                 materialize="always")
    rt.send_message(cid, "First.", forced={"reasoning": "Think about it. " * 5, "content": "An answer. " * 3})
    rt.materializer.run_pending()
    step = rt.send_message(cid, "Second.", max_tokens=NEW, logprobs=True)
    assert step.accounting.cache_state == "canonical_branch"
    chain = list(rt.get(cid).chain_tokens)
    prompt = chain[:step.accounting.prompt_tokens]
    assert list(step.output_ids)[:len(chain) - len(prompt)] == chain[len(prompt):]  # the last one is not fed yet
    tokens, logprobs = _greedy(hf, prompt, len(step.output_ids))
    assert list(step.output_ids) == tokens
    assert step.logprobs == pytest.approx(logprobs, abs=2e-3)


def test_a_hundred_dropped_turns_leak_no_page(sglang_rt):
    """Four conversations, 25 turns each, every turn dropping its reasoning at a
    close that falls inside a page (a private partial page, a fork-page copy):
    once they are deleted the pool's free pages are where they started."""
    rt = sglang_rt
    backend = rt.backend
    start = _pages_free(backend)
    cids = [rt.create_conversation(system=f"Leak check {i}.", policy="drop", materialize="never")
            for i in range(4)]
    for turn in range(25):
        for i, cid in enumerate(cids):
            rt.send_message(cid, f"Q{turn}.", forced={"reasoning": "Hm" + "m" * (turn % 5), "content": f"A{i}."})
    backend.check_integrity()
    assert backend.pools()["private"] > 0  # closes inside pages took private pages
    for cid in cids:
        rt.delete_conversation(cid)
    assert backend.pools()["private"] == 0
    assert _pages_free(backend) == start
