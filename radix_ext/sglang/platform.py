"""An out-of-tree SGLang platform that runs the real server on a plain CPU.

SGLang's in-tree CPU platform needs `sgl_kernel`'s CPU ops, which the PyPI
wheel does not ship; with no platform at all `rotary_embedding/base.py`
imports `vllm._custom_ops`. An OOT platform whose dispatch key is "native"
makes every fused op run its `forward_native` torch code instead.

It switches on only when asked: `SESSION_RUNTIME_SGLANG_CPU=1` (our CLI sets
it for `--backend sglang --device cpu`) or `SGLANG_PLATFORM=session_cpu`.
An explicit request wins even on a host with a GPU; nothing turns it on by
default, so installing this package never takes over a GPU host.
"""

from __future__ import annotations

import os
from typing import Optional

ENV = "SESSION_RUNTIME_SGLANG_CPU"
NAME = "session_cpu"


def activate() -> Optional[str]:
    """Entry point of `sglang.srt.platforms`: the class path when asked, else None."""
    asked = os.environ.get(ENV, "") == "1" or os.environ.get("SGLANG_PLATFORM", "") == NAME
    return "radix_ext.sglang.platform.SessionCpuPlatform" if asked else None


def _platform_class():
    from sglang.srt.platforms.cpu import CpuDeviceMixin
    from sglang.srt.platforms.interface import PlatformCapabilities, PlatformEnum, SRTPlatform

    class SessionCpuPlatform(CpuDeviceMixin, SRTPlatform):
        """SGLang on a plain CPU: torch-native attention and sampling, no graphs."""

        _enum = PlatformEnum.OOT
        device_name = "cpu"
        device_type = "cpu"
        capabilities = PlatformCapabilities()

        def get_dispatch_key_name(self) -> str:
            return "native"

        def get_device(self, device_id: int = 0) -> str:
            # A string, not torch.device: serving_hook.py calls .split(":") on it.
            return "cpu"

        def is_pin_memory_available(self, device=None) -> bool:
            return False

        def get_default_attention_backend(self) -> str:
            return "torch_native"

        def apply_server_args_defaults(self, server_args) -> None:
            if server_args.attention_backend in (None, "intel_amx"):
                server_args.attention_backend = "torch_native"
            server_args.sampling_backend = "pytorch"

    return SessionCpuPlatform


def __getattr__(name: str):
    # The class subclasses SGLang's platform types: build it only when SGLang
    # asks for it, so `activate()` stays import-free.
    if name == "SessionCpuPlatform":
        cls = _platform_class()
        globals()[name] = cls
        return cls
    raise AttributeError(name)
