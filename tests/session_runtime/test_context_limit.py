"""--max-context defaults to the model's own limit (max_position_embeddings of
the preset or folder) on every backend, and a larger one is refused at start
naming both numbers. (On SGLang's server: the shared test server is launched
from a folder whose limit is 4096 with no max_context given,
tests/backends/test_sglang_tree.py.)"""

from __future__ import annotations

import json

import pytest

from session_runtime.cli import main
from session_runtime.config import DEFAULT_CONTEXT, PRESETS, RuntimeConfig, model_context_limit


def _folder(tmp_path, limit):
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": limit}))
    return str(tmp_path)


def test_the_default_is_the_models_own_limit(tmp_path):
    assert RuntimeConfig(model=_folder(tmp_path, 4096)).max_context == 4096
    assert RuntimeConfig(model=_folder(tmp_path, 4096)).context_from_model
    assert RuntimeConfig(model="tiny").max_context == PRESETS["tiny"].max_position_embeddings
    assert RuntimeConfig(model=_folder(tmp_path, 4096), max_context=1024).max_context == 1024
    assert model_context_limit(str(tmp_path / "nowhere")) is None
    assert RuntimeConfig(model=str(tmp_path / "nowhere")).max_context == DEFAULT_CONTEXT


def test_a_larger_context_than_the_models_is_refused_naming_both(tmp_path, capsys):
    folder = _folder(tmp_path, 4096)
    with pytest.raises(ValueError, match="max_context 8192 is larger than the model's own limit of 4096"):
        RuntimeConfig(model=folder, max_context=8192)
    assert main(["serve", "--backend", "sglang", "--model", folder, "--max-context", "8192"]) == 2
    assert "larger than the model's own limit of 4096" in capsys.readouterr().err
