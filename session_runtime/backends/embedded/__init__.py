"""The embedded backend: our Qwen3/Llama decoder over SGLang's pools and
`SessionRadixCache`, in this process, one step at a time."""

from __future__ import annotations

from session_runtime.backends.embedded.engine import Engine
from session_runtime.constrained.matcher import Guards
from session_runtime.errors import InvalidRequest


def build(config, tokenizer) -> Engine:
    """The engine with the configured model, warmed up (or only its shape:
    `config.run_model` False). Raises InvalidRequest."""
    if config.run_model:
        from session_runtime.model.weights import decoder_for

        decoder = decoder_for(config, min_vocab=tokenizer.vocab_size)
    else:
        from session_runtime.model.token_only import token_only_for

        decoder = token_only_for(config, min_vocab=tokenizer.vocab_size)
    if tokenizer.vocab_size > decoder.cfg.vocab_size:
        raise InvalidRequest(f"tokenizer has {tokenizer.vocab_size} ids, the model only {decoder.cfg.vocab_size}")
    engine = Engine(config, decoder, Guards(tokenizer))
    engine.warmup()
    return engine
