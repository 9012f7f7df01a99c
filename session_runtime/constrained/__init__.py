"""Output the client constrains: a tool call it forces (or forbids), a JSON
schema for the answer, stop sequences, a bound on the reasoning.

- `wire.py`: each protocol's fields read into an `OutputConstraint`, checked
  as the provider checks them.
- `spec.py`: `OutputConstraint`, what a request asks, whatever its protocol.
- `grammar.py`: the answer's grammar, an xgrammar structural tag written in the
  chat template's own call syntax (`dsml.py`: DeepSeek's arguments), and the
  whole output's for SGLang, reasoning block included.
- `matcher.py`: the embedded engine's guard: the reasoning block's bound, the
  answer's token mask (xgrammar), the stop-sequence watch; `--backend sglang`
  sends the whole tag and the stop strings to SGLang's grammar backend instead.

It imports templates and the tokenizer, never a backend or the HTTP layer.

May import the templates, the protocols' shapes and the sampling parameters;
nothing above.
"""

from session_runtime.constrained.spec import OutputConstraint

__all__ = ["OutputConstraint"]
