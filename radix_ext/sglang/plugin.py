"""Entry point of `sglang.srt.plugins`: registers the `session` radix-cache
backend, the hooks through which it sees each request at intake (and
finishes command requests there, unrun), and the one that makes its
per-request report a request-level `meta_info` key.

SGLang calls `register()` with no arguments in every process, before the tree
cache is built. The intake hook runs before `Scheduler.process_input_requests`,
which both event loops (normal and overlap) call once per iteration, between
batches, on the scheduler's own thread, with the requests just received (the
same list on every tensor-parallel rank).
"""

from __future__ import annotations

HOOK_TARGET = "sglang.srt.managers.scheduler.Scheduler.process_input_requests"
REPORT_HOOK_TARGET = ("sglang.srt.managers.scheduler_components.output_streamer."
                      "SchedulerOutputStreamer.is_request_level_customized_info_key")


def register() -> None:
    from sglang.srt.mem_cache.registry import get_radix_cache_factory, register_radix_cache_backend
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from radix_ext.sglang import mla_attention
    from radix_ext.sglang.cache import BACKEND_NAME, build
    from radix_ext.sglang.platform import activate
    from radix_ext.sglang.report import is_request_level

    if get_radix_cache_factory(BACKEND_NAME) is None:
        register_radix_cache_backend(BACKEND_NAME, build)
        HookRegistry.register(HOOK_TARGET, intake, HookType.BEFORE)
        HookRegistry.register(HOOK_TARGET, finish_commands, HookType.AFTER)
        HookRegistry.register(REPORT_HOOK_TARGET, is_request_level, HookType.AROUND)
    if activate():
        mla_attention.register()  # DeepSeek's MLA on the CPU platform's torch_native


def finish_commands(result, scheduler, *args, **kwargs):
    """AFTER hook: the command requests just queued finish at once, answered,
    without a forward pass; and the requests just queued that do not fit get
    the room held chains keep (pressure.py) before the scheduler picks its
    next batch, not at the next request's arrival."""
    cache = getattr(scheduler, "tree_cache", None)
    if hasattr(cache, "finish_commands"):
        cache.finish_commands(scheduler)
        cache.relieve(scheduler)
    return None


def intake(scheduler, recv_reqs=None, *args, **kwargs):
    """BEFORE hook: answer the commands among the received requests, run the
    steps' pre-actions, retire idle chains that are due, then let the
    scheduler process its inputs."""
    cache = getattr(scheduler, "tree_cache", None)
    if hasattr(cache, "intake"):
        cache.intake(scheduler, recv_reqs)
        cache.relieve(scheduler)  # tool waits and idle chains, under pressure or past their TTL
    return None
