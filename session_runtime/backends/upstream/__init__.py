"""Upstream proxy mode: a provider's API answers each step (backend.py)."""

from __future__ import annotations


def build(config, tokenizer):
    from session_runtime.backends.upstream.backend import UpstreamBackend

    return UpstreamBackend(config, tokenizer)
