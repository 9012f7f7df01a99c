"""Every KV layout of SGLang's pools (kv_layout.py), on SGLang's real pool
classes on CPU: a slot-range copy, a page copy and a host round trip move the
pool's own bytes (bit-identical, the token's KV read from the buffers as
SGLang lays them out); pools the tree cannot copy are refused by name; a
fork-page copy that fails frees the page it took."""

from __future__ import annotations

import pytest
import torch

from radix_ext.kv_copy import KVMover
from radix_ext.kv_layout import UnsupportedLayout, layout_of

PAGE, SIZE, LAYERS = 4, 64, 3


def _mha(monkeypatch, dtype=torch.float32, hnd=False, v_head_dim=None):
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    if hnd:
        monkeypatch.setenv("SGLANG_USE_HND_KVCACHE", "1")
    pool = MHATokenToKVPool(SIZE, PAGE, dtype, 2, 8, LAYERS, "cpu", False, v_head_dim=v_head_dim,
                            enable_alt_stream=False)
    monkeypatch.delenv("SGLANG_USE_HND_KVCACHE", raising=False)
    return pool, [pool.k_buffer, pool.v_buffer]


def _mla(monkeypatch, dtype=torch.bfloat16):
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool

    pool = MLATokenToKVPool(SIZE, PAGE, dtype, 16, 8, LAYERS, "cpu", False)
    return pool, [pool.kv_buffer]


POOLS = {
    "mha-nhd": lambda mp: _mha(mp),
    "mha-nhd, v_head_dim 4": lambda mp: _mha(mp, v_head_dim=4),
    "mha-nhd, fp8": lambda mp: _mha(mp, dtype=torch.float8_e4m3fn),
    "mha-hnd": lambda mp: _mha(mp, hnd=True),
    "mla": lambda mp: _mla(mp),
    "mla, fp8": lambda mp: _mla(mp, dtype=torch.float8_e4m3fn),
}


def _token(buf: torch.Tensor, slot: int, hnd: bool) -> bytes:
    """One token's KV as SGLang lays it out, as bytes."""
    t = buf[slot // PAGE, :, slot % PAGE] if hnd else buf[slot]
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def _tokens(planes, slots, hnd: bool) -> list:
    return [[[_token(b, s, hnd) for s in slots] for b in plane] for plane in planes]


def _fill(planes) -> None:
    g = torch.Generator().manual_seed(0)
    for plane in planes:
        for b in plane:
            b.view(torch.uint8).copy_(torch.randint(0, 256, b.view(torch.uint8).shape, generator=g,
                                                    dtype=torch.uint8))


@pytest.mark.parametrize("name", sorted(POOLS))
def test_slot_range_and_page_copies_are_bit_identical(name, monkeypatch):
    pool, planes = POOLS[name](monkeypatch)
    layout = layout_of(pool)
    assert layout.name == name.split(",")[0]
    hnd = layout.name == "mha-hnd"
    _fill(planes)
    src, dst = torch.tensor([5, 6, 7, 9, 10]), torch.tensor([33, 34, 35, 36, 37])  # across a page boundary
    want = _tokens(planes, src.tolist(), hnd)
    untouched = _tokens(planes, [32, 38], hnd)
    layout.copy_slots(src, dst)
    assert _tokens(planes, dst.tolist(), hnd) == want
    assert _tokens(planes, [32, 38], hnd) == untouched  # nothing else written
    page, other = torch.arange(8, 12), torch.arange(48, 52)  # a whole page
    want = _tokens(planes, page.tolist(), hnd)
    layout.copy_slots(page, other)
    assert _tokens(planes, other.tolist(), hnd) == want
    per_token = sum(b[0].numel() * b.element_size() // (PAGE if hnd else 1) for b in (p[0] for p in planes))
    assert layout.bytes_per_token == LAYERS * per_token


@pytest.mark.parametrize("name", sorted(POOLS))
def test_a_host_round_trip_is_bit_identical(name, monkeypatch):
    pool, planes = POOLS[name](monkeypatch)
    hnd = layout_of(pool).name == "mha-hnd"
    _fill(planes)
    mover = KVMover(pool)
    slots, back = torch.tensor([1, 2, 3, 4, 5, 6, 13]), torch.tensor([40, 41, 42, 43, 44, 45, 46])
    want = _tokens(planes, slots.tolist(), hnd)
    host = mover.empty(len(slots))
    mover.to_host(slots, host)
    assert host.nbytes == len(slots) * layout_of(pool).bytes_per_token
    if not hnd and len(planes) == 2 and hasattr(pool, "get_cpu_copy"):  # SGLang's own copy, where it has one
        theirs = pool.get_cpu_copy(slots)
        for layer in range(LAYERS):
            for mine, i in ((host.k[layer], 0), (host.v[layer], 1)):  # as bytes: random bits hold NaNs
                assert torch.equal(mine.view(torch.uint8), torch.cat([c[i] for c in theirs[layer]]).view(torch.uint8))
    for plane in planes:  # the device copy is gone
        for b in plane:
            b.zero_()
    mover.to_device(host, back)
    assert _tokens(planes, back.tolist(), hnd) == want


def test_pools_the_tree_cannot_copy_are_refused_by_name(monkeypatch):
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool

    with pytest.raises(UnsupportedLayout, match="the object KV pool"):
        layout_of(object())
    pool, _ = _mha(monkeypatch)
    pool.k_scale_buffer = [torch.ones(SIZE + PAGE)]
    with pytest.raises(UnsupportedLayout, match="scale buffers"):
        layout_of(pool)
    pool, _ = _mha(monkeypatch)
    pool.kv_cache_layout = "vectorized_5d"
    with pytest.raises(UnsupportedLayout, match="'vectorized_5d' KV layout"):
        layout_of(pool)
    dsa = MLATokenToKVPool(SIZE, PAGE, torch.bfloat16, 16, 8, LAYERS, "cpu", False)
    dsa.use_dsa = True
    with pytest.raises(UnsupportedLayout, match="DSA"):
        layout_of(dsa)


def test_a_fork_page_copy_that_fails_frees_the_page_it_took(monkeypatch):
    """The leak the issue names: the copy failed after the page was allocated."""
    from radix_ext import tree as tree_module
    from tests.radix_ext.test_tree import NS, make_tree, put

    tree = make_tree(page_size=PAGE, pool_tokens=64)
    put(tree, list(range(1, 13)), owner="c")  # three full pages
    alloc = tree.token_to_kv_pool_allocator
    free_before = alloc.available_size()

    def broken(*_args):
        raise AttributeError("'MLATokenToKVPool' object has no attribute 'k_buffer'")

    monkeypatch.setattr(tree_module, "copy_slots", broken)
    with pytest.raises(AttributeError):  # the fork at 6: a private page for tokens 5 and 6
        tree.hold_prefix("c", NS.key(list(range(1, 7)) + [99]), free_branch=False)
    assert alloc.available_size() == free_before
    tree.check_integrity()


def test_the_runtime_counts_an_mla_folders_kv_as_its_latent(tmp_path):
    import json

    from session_runtime.backends.sglang import _kv_shape

    config = {"num_hidden_layers": 3, "num_attention_heads": 8, "hidden_size": 256, "vocab_size": 1000,
              "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 32, "v_head_dim": 32}
    (tmp_path / "config.json").write_text(json.dumps(config))
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool

    pool = MLATokenToKVPool(SIZE, PAGE, torch.bfloat16, 16, 8, 3, "cpu", False)
    assert _kv_shape(tmp_path, "bfloat16") == (layout_of(pool).bytes_per_token, 1000)
