"""Output the client constrains: a tool call it forces, a JSON schema for the
answer, stop sequences.

- `spec.py`: `OutputConstraint`, what a request asks, whatever its protocol.
- `grammar.py`: the step's grammar, an xgrammar structural tag written in the
  chat template's own call syntax, with the reasoning block left free.
- `matcher.py`: the embedded engine's token mask (xgrammar) and stop-sequence
  watch; `--backend sglang` sends the same structural tag and stop strings to
  SGLang's grammar backend instead.

It imports templates and the tokenizer, never a backend or the HTTP layer.
"""

from session_runtime.constrained.spec import OutputConstraint

__all__ = ["OutputConstraint"]
