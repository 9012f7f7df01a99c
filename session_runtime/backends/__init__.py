"""The backends, each in its folder (embedded/, sglang/, upstream/) over the
interface in base.py. `create_backend` picks one by name and imports it
lazily (SGLang's server needs none of the embedded decoder, and the other way
round); base.py imports none of them.

May import the core modules, the model, the templates, the protocols, the
constrained output and the proxy (upstream mode); never the runtime, the
store, the API or the CLI.
"""

from __future__ import annotations

from session_runtime.backends.base import Backend
from session_runtime.config import BACKENDS


def create_backend(config, tokenizer) -> Backend:
    """The configured backend, imported lazily (SGLang's server needs none of
    the embedded decoder, and the other way round). Raises InvalidRequest."""
    if config.backend == "embedded":
        from session_runtime.backends.embedded import build

        return build(config, tokenizer)
    if config.backend == "sglang":
        from session_runtime.backends.sglang import build

        return build(config, tokenizer)
    if config.backend == "upstream":
        from session_runtime.backends.upstream import build

        return build(config, tokenizer)
    raise ValueError(f"backend must be one of {BACKENDS}, got {config.backend!r}")
