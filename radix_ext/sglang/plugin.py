"""Entry point of `sglang.srt.plugins`: registers the `session` radix-cache
backend and the hook that serves its control channel.

SGLang calls `register()` with no arguments in every process, before the tree
cache is built. The hook runs before `Scheduler.process_input_requests`,
which both event loops (normal and overlap) call once per iteration, between
batches, on the scheduler's own thread.
"""

from __future__ import annotations

HOOK_TARGET = "sglang.srt.managers.scheduler.Scheduler.process_input_requests"


def register() -> None:
    from sglang.srt.mem_cache.registry import get_radix_cache_factory, register_radix_cache_backend
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from radix_ext.sglang.cache import BACKEND_NAME, build

    if get_radix_cache_factory(BACKEND_NAME) is None:
        register_radix_cache_backend(BACKEND_NAME, build)
        HookRegistry.register(HOOK_TARGET, serve_control, HookType.BEFORE)


def serve_control(scheduler, *args, **kwargs):
    """BEFORE hook: answer the control channel's waiting commands and retire
    idle chains that are due, then let the scheduler process its inputs."""
    cache = getattr(scheduler, "tree_cache", None)
    control = getattr(cache, "control", None)
    if control is not None:
        control.serve(scheduler)
        cache.relieve(scheduler)  # tool waits and idle chains, under pressure or past their TTL
    return None
