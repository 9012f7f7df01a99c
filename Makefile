# `make serve` runs the server with the embedded default engine; `make test`
# runs the test suite. Each creates .venv from uv.lock on first use.
PY := .venv/bin/python
UV := $(shell command -v uv 2>/dev/null || echo .venv-uv/bin/uv)

.PHONY: serve test bench venv

$(UV):
	python3 -m venv .venv-uv && .venv-uv/bin/pip install -q uv

# Bytecode compiled once at install: every process (the runtime, each SGLang
# server process) otherwise compiles what it imports, about 20 s with
# PYTHONDONTWRITEBYTECODE set.
.venv/.synced: pyproject.toml uv.lock | $(UV)
	$(UV) sync --frozen --extra test --compile-bytecode
	touch $@

venv: .venv/.synced

serve: .venv/.synced
	.venv/bin/session-runtime serve $(ARGS)

# The agent CLIs the harness tests run (tests/harness/package-lock.json); Claude
# Code's native binary is put in place by its install script, run here in case
# npm skipped install scripts.
HARNESS := tests/harness/node_modules/.installed
$(HARNESS): tests/harness/package.json tests/harness/package-lock.json
	cd tests/harness && npm ci --no-audit --no-fund --loglevel=error && node node_modules/@anthropic-ai/claude-code/install.cjs
	touch $@

test: .venv/.synced $(HARNESS)
	$(PY) -m pytest -q $(ARGS)

bench: .venv/.synced
	$(PY) bench/engine.py
