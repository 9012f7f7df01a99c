"""A model folder whose answers end: the tiny shape with weights set by hand so
that it answers every prompt with an empty reasoning, "Hello" and the end of
the turn (`</think>`, "Hello", `<｜end▁of▁sentence｜>`), under the DeepSeek
template and tokenizer.

Random weights never emit the end of a turn, so an agent CLI sees every answer
end on its output cap, treats that as an error and never sends the answer back
(Claude Code asks the turn again with a reminder, and its `--continue` resumes
with "Continue from where you left off." after a placeholder of its own). A
harness test that wants the CLI to continue a conversation needs answers that
end. This one is a real Qwen3 model served by the real engines; its layers
add nothing (their output projections are zero), so the next token depends
only on the current one, and the embeddings and output head spell out the
three-state chain:

    any other token -> </think> -> "Hello" -> end of sentence
"""

from __future__ import annotations

from pathlib import Path

import torch

SCALE = 50.0  # the chosen token's logit after the final RMSNorm; every other token's is 0


def save_answering_model(folder: Path, shape: dict, tokenizer) -> Path:
    """Save the model of `shape` (tests/conftest.py's TINY_SHAPE keys, plus
    max_position_embeddings) into `folder`, for `tokenizer`'s ids. Returns the folder."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    end_think = tokenizer.token_id("</think>")
    hello = tokenizer.encode_text("Hello")
    assert len(hello) == 1, f"'Hello' is {hello} in this tokenizer: pick a word that is one token"
    hello = hello[0]
    eos = tokenizer.token_id("<｜end▁of▁sentence｜>")
    s = shape
    cfg = Qwen3Config(
        vocab_size=s["vocab_size"], hidden_size=s["hidden_size"], num_hidden_layers=s["num_layers"],
        num_attention_heads=s["num_heads"], num_key_value_heads=s["num_kv_heads"], head_dim=s["head_dim"],
        intermediate_size=s["intermediate_size"], rope_theta=s["rope_theta"], rms_norm_eps=s["rms_norm_eps"],
        max_position_embeddings=s["max_position_embeddings"], tie_word_embeddings=False,
    )
    model = Qwen3ForCausalLM(cfg).eval()
    make_state_machine(model, {end_think: hello, hello: eos}, otherwise=end_think)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def make_state_machine(model, table: dict[int, int], otherwise: int, scale: float = SCALE) -> None:
    """Make a Qwen3 model (untied head) answer by table: greedy, the token after
    `t` is `table[t]`, after any other token `otherwise`. Its layers add nothing
    (every weight zero, norms one), so the next token depends only on the
    current one: each state is its own orthogonal direction in the embedding,
    and the head maps it to the chosen token with logit `scale` (after RMSNorm a
    direction has norm sqrt(hidden)), every other token's logit 0."""
    hidden = model.config.hidden_size
    assert len(table) + 1 <= hidden, "one embedding direction per state"
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.zero_()  # o_proj and down_proj zero: every layer adds nothing to the residual stream
        emb, head = model.model.embed_tokens.weight, model.lm_head.weight
        state = torch.eye(len(table) + 1, hidden)
        unit = scale / hidden ** 0.5
        emb[:] = state[-1]
        head[otherwise] += state[-1] * unit
        for k, (token, following) in enumerate(table.items()):
            emb[token] = state[k]
            head[following] += state[k] * unit
