"""GPU checks: the qwen3-0.6b shape in bf16 on CUDA against transformers,
flashinfer attention against SDPA, and the host round trip on CUDA. Skipped
where there is no GPU (CI, this project's CPU machines); `bench/gpu.sh` runs
them on a lent GPU."""

from __future__ import annotations

import importlib.util

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
# sglang's full install brings flashinfer; on the lent GPU host it comes from
# bench/gpu_bundle.py's archive (without it, these tests skip).
needs_flashinfer = pytest.mark.skipif(importlib.util.find_spec("flashinfer") is None,
                                      reason="flashinfer is not installed")


@pytest.fixture(scope="module")
def pair():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from session_runtime.config import PRESETS
    from session_runtime.model.decoder import Decoder

    cfg = PRESETS["qwen3-0.6b"]
    hf_cfg = Qwen3Config(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_layers,
                         num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
                         head_dim=cfg.head_dim, intermediate_size=cfg.intermediate_size, rope_theta=cfg.rope_theta,
                         rms_norm_eps=cfg.rms_norm_eps, tie_word_embeddings=True, attn_implementation="sdpa")
    torch.manual_seed(0)
    hf = Qwen3ForCausalLM(hf_cfg).to("cuda", torch.bfloat16).eval()
    ours = Decoder(cfg)
    ours.load_state_dict(hf.state_dict())
    return hf, ours.to("cuda", torch.bfloat16).eval()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def test_bf16_oracle_cold_prefix_and_decode(pair):
    from radix_ext.tree import Namespace
    from session_runtime.config import RuntimeConfig
    from session_runtime.backends.embedded.engine import Engine, StepRequest
    from session_runtime.sampling import SamplingParams

    hf, ours = pair
    eng = Engine(RuntimeConfig(device="cuda", dtype="bfloat16", page_size=16, pool_tokens=16384,
                               host_pool_tokens=0, max_context=8192), ours)
    ids = torch.randint(0, 150000, (1000,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([ids], device="cuda")).logits[0]
    ns = Namespace("gpu")
    cold = eng.step(StepRequest(owner="a", prompt=ids[:700], namespace=ns, forced=[], return_logits=True))
    assert rel(cold.logits, ref[:700]) < 3e-2
    warm = eng.step(StepRequest(owner="a", prompt=ids, namespace=ns, forced=[], return_logits=True))
    assert warm.accounting.cached_input_tokens == 688  # 700 rounded down to pages of 16
    assert rel(warm.logits, ref[688:]) < 3e-2
    dec = eng.step(StepRequest(owner="b", prompt=ids[:500], namespace=Namespace("gpu-dec"),
                               sampling=SamplingParams(max_tokens=8), return_logits=True))
    seq = ids[:500] + dec.output[:-1]
    with torch.no_grad():
        ref_dec = hf(torch.tensor([seq], device="cuda")).logits[0]
    assert rel(dec.logits[-7:], ref_dec[-7:]) < 3e-2
    eng.check_integrity()


def backend_logits(ours, backend, ids: list[int], slots: torch.Tensor, kv) -> list[torch.Tensor]:
    """With `backend`: a cold prefill of ids[:700], the rest after the 688 cached
    (whole pages of 16, so 1000 ends mid-page), then one token at a time (decode)."""
    from session_runtime.model.attention import SdpaAttention

    def forward(start: int, end: int) -> torch.Tensor:
        return ours(torch.tensor(ids[start:end], device="cuda"), torch.arange(start, end, device="cuda"),
                    slots[start:end], slots[:end], kv, all_logits=True)

    ours.set_attention(backend)
    try:
        return [forward(0, 700), forward(688, 1000), torch.cat([forward(i, i + 1) for i in range(1000, 1008)])]
    finally:
        ours.set_attention(SdpaAttention())


@needs_flashinfer
def test_flashinfer_matches_sdpa(pair):
    from radix_ext.pools import PoolSpec, build_pools
    from session_runtime.model.attention import SdpaAttention, make_attention

    _, ours = pair
    cfg = ours.cfg
    pools = build_pools(PoolSpec(pool_tokens=4096, page_size=16, max_running=1, max_context=2048,
                                 num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                                 dtype=torch.bfloat16, device="cuda"))
    gen = torch.Generator().manual_seed(2)
    # 63 whole pages in shuffled order: flashinfer must follow kv_indices, not slot order.
    pages = pools.allocator.alloc(1008).view(63, 16)
    slots = pages[torch.randperm(63, generator=gen).to(pages.device)].flatten()
    ids = torch.randint(0, 150000, (1008,), generator=gen).tolist()
    flashinfer = make_attention("flashinfer", cfg, torch.bfloat16, "cuda")
    sdpa = backend_logits(ours, SdpaAttention(), ids, slots, pools.kv)
    fi = backend_logits(ours, flashinfer, ids, slots, pools.kv)
    for part, (a, b) in zip(("cold", "suffix", "decode"), zip(fi, sdpa)):
        assert a.shape == b.shape, part
        assert rel(a, b) < 3e-2, part


@needs_flashinfer
def test_auto_picks_flashinfer_on_cuda():
    from session_runtime.config import PRESETS
    from session_runtime.model.attention import make_attention

    assert make_attention("auto", PRESETS["qwen3-0.6b"], torch.bfloat16, "cuda").name == "flashinfer"


def test_host_round_trip_on_cuda_is_bit_identical():
    from session_runtime import Runtime, RuntimeConfig

    rt = Runtime(RuntimeConfig(device="cuda", dtype="bfloat16", pool_tokens=8192, host_pool_tokens=4096),
                 background=False)
    try:
        cid = rt.create_conversation(system=" alpha" * 200, offload="always")
        step = rt.send_message(cid, "go", forced={"reasoning": " alpha" * 100, "tool_calls": [{"name": "f", "arguments": {}}]})
        slots = rt.engine.tree.chain_slots(cid)
        kv = rt.engine.pools.kv
        before = [kv.k_buffer[i][slots].clone() for i in range(len(kv.k_buffer))]
        assert rt.offload.run_due() == len(slots)
        nxt = rt.send_tool_results(cid, [{"tool_call_id": step.tool_calls[0]["id"], "content": "ok"}],
                                   forced={"tool_calls": [{"name": "f", "arguments": {"x": 1}}]})
        assert nxt.accounting.host_loaded_tokens == len(slots)
        after_slots = rt.engine.tree.chain_slots(cid)[: len(slots)]
        for i, k in enumerate(before):
            assert torch.equal(k, kv.k_buffer[i][after_slots])
        rt.check_integrity()
    finally:
        rt.close()
