"""DeepSeek's MLA on SGLang's CPU path: the absorbed form, in torch.

SGLang's `torch_native` backend reads K and V from the pool by layer; on an
MLA pool that is the latent (`kv_lora_rank + qk_rope_head_dim` per token, one
head) and its first `kv_lora_rank` columns. That is exactly what the absorbed
("MLA") forward of DeepSeek's attention needs: the query is `W_kc`-absorbed
(`kv_lora_rank` wide) plus its rope part, one shared KV head, V the latent.
What breaks on CPU is the choice of forward: DeepSeek's attention asks the
backend's name which forward to run, and for names it does not know it takes
Triton's rule, the decompressed ("MHA") forward on a prefill with no cached
prefix, which hands K and V of `qk_nope + rope` width to the attention while
the pool holds the latent; `torch_native` reads the pool and fails.

So the CPU platform's `torch_native` builds, for an MLA model, this backend:
`torch_native`'s own kernels under a name of its own, `session_cpu_mla`,
whose forward is always the absorbed one (prefill, prefill over a cached
prefix, decode). Every token's K/V then lives only in the latent pool, which
is what the radix tree shares, copies and offloads. Server arguments keep
saying `torch_native`, so every other CPU rule of SGLang (no CUDA graphs, no
Triton) still holds.

Correctness first: the oracle is transformers' DeepseekV3 in float32
(`tests/backends/test_sglang_mla.py`).
"""

from __future__ import annotations

NAME = "session_cpu_mla"


def register() -> None:
    """Make `torch_native` build this backend for MLA models. Called by the
    plugin in SGLang's processes, only when the CPU platform is active."""
    from sglang.srt.layers.attention import attention_registry
    from sglang.srt.models.deepseek_common.attention_backend_handler import AttentionBackendRegistry
    from sglang.srt.models.deepseek_common.attention_forward_methods.forward_methods import AttnForwardMethod

    native = attention_registry.ATTENTION_BACKENDS["torch_native"]
    if getattr(native, "_session_mla", False):
        return

    def create(runner):
        if not runner.use_mla_backend:
            return native(runner)
        return _backend_class()(runner)

    create._session_mla = True
    attention_registry.register_attention_backend("torch_native")(create)
    AttentionBackendRegistry.register(NAME, lambda attn, forward_batch: AttnForwardMethod.MLA)


def _backend_class():
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    class CpuMlaAttnBackend(TorchNativeAttnBackend):
        """`torch_native` over the latent pool, named so that DeepSeek's
        attention always runs its absorbed forward."""

        # SGLang stamps the server's backend name ("torch_native") on the
        # object after building it (`attention_backend_setup.py`); DeepSeek's
        # attention reads the stamp to pick its forward. Ours stays ours.
        prefill_attention_backend_str = property(lambda self: NAME, lambda self, value: None)
        decode_attention_backend_str = property(lambda self: NAME, lambda self, value: None)

    return CpuMlaAttnBackend
