"""Running the real agent CLIs (Claude Code, Codex CLI, Gemini CLI) (pinned in package.json / package-lock.json
beside this file, installed by `make test` with `npm ci`) against a server of
the test's, each in a temporary HOME and working folder of its own.

Nothing here skips: a CLI that is not installed or cannot run fails the test
that needs it (../shared/DECISIONS.md).
"""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

import httpx

BIN = Path(__file__).parent / "node_modules" / ".bin"
TIMEOUT_S = 300


@dataclass(frozen=True)
class Run:
    """One CLI invocation's result."""

    returncode: int
    stdout: str
    stderr: str


def _run(argv: list[str], env: dict, cwd: Path) -> Run:
    exe = BIN / argv[0]
    assert exe.exists(), f"{exe} is missing: run `make test` (it installs tests/harness with npm ci)"
    full = {"PATH": os.environ.get("PATH", ""), "LANG": "C.UTF-8", **env}
    p = subprocess.run([str(exe), *argv[1:]], env=full, cwd=cwd, capture_output=True, text=True, timeout=TIMEOUT_S)
    return Run(p.returncode, p.stdout, p.stderr)


def _json_result(run: Run, cli: str) -> dict:
    """The JSON result a CLI printed. Raises AssertionError with its output where it printed none."""
    try:
        return json.loads(run.stdout)
    except ValueError:
        raise AssertionError(f"{cli} printed no JSON result (exit {run.returncode}): {run.stdout[-2000:]}"
                             f"{run.stderr[-2000:]}") from None


class ClaudeCode:
    """`claude -p` pointed at `url`, asking for `model`; `extra`: more flags."""

    def __init__(self, url: str, model: str, home: Path, extra: tuple[str, ...] = ()):
        self.home, self.model, self.extra = home, model, extra
        self.work = home / "work"
        self.work.mkdir(parents=True, exist_ok=True)
        self.env = {"HOME": str(home), "ANTHROPIC_BASE_URL": url, "ANTHROPIC_API_KEY": "test-key",
                    "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_TELEMETRY": "1",
                    "CLAUDE_CODE_MAX_OUTPUT_TOKENS": "16", "ANTHROPIC_MODEL": model,
                    "ANTHROPIC_DEFAULT_HAIKU_MODEL": model, "ANTHROPIC_DEFAULT_SONNET_MODEL": model}

    def ask(self, prompt: str, resume: bool = False) -> dict:
        """The CLI's JSON result of one `claude -p` (`--continue` for the next turn)."""
        argv = ["claude", "-p", *(["--continue"] if resume else []), prompt, "--model", self.model,
                "--output-format", "json", *self.extra]
        return _json_result(_run(argv, self.env, self.work), "claude")


def claude_ok(result: dict) -> bool:
    """The CLI's result is an answer, not an error."""
    return result.get("type") == "result" and not result.get("is_error") and result.get("api_error_status") is None


class Codex:
    """`codex exec` pointed at `url` (`/v1`, wire API responses) asking for `model`."""

    def __init__(self, url: str, model: str, home: Path):
        self.work = home / "work"
        self.work.mkdir(parents=True, exist_ok=True)
        (home / ".codex").mkdir(exist_ok=True)
        (home / ".codex" / "config.toml").write_text(
            f'model = "{model}"\nmodel_provider = "local"\n\n[model_providers.local]\nname = "local"\n'
            f'base_url = "{url}/v1"\nwire_api = "responses"\nenv_key = "SR_TEST_KEY"\n')
        self.env = {"HOME": str(home), "SR_TEST_KEY": "test-key", "RUST_LOG": "error"}

    def ask(self, prompt: str, resume: bool = False) -> Run:
        argv = ["codex", "exec", "--skip-git-repo-check", *(["resume", "--last"] if resume else []), prompt]
        return _run(argv, self.env, self.work)


def codex_ok(run: Run) -> bool:
    """The CLI exited 0 and printed no error."""
    return run.returncode == 0 and not any(line.startswith("ERROR") for line in run.stderr.splitlines())


class GeminiCLI:
    """`gemini -p` pointed at `url` (Gemini API key auth, as its settings must
    say for a custom base URL) asking for `model`."""

    def __init__(self, url: str, model: str, home: Path):
        self.model = model
        self.work = home / "work"
        self.work.mkdir(parents=True, exist_ok=True)
        (home / ".gemini").mkdir(exist_ok=True)
        # Skills off: the CLI lists its built-in skills in its system prompt in an order that varies
        # from one run to the next, so a resumed session's system prompt would differ from the first
        # run's about half the time, which is a new conversation by the inference's rules.
        (home / ".gemini" / "settings.json").write_text(
            json.dumps({"security": {"auth": {"selectedType": "gemini-api-key"}}, "skills": {"enabled": False}}))
        self.env = {"HOME": str(home), "GOOGLE_GEMINI_BASE_URL": url, "GEMINI_API_KEY": "test-key",
                    "GEMINI_CLI_TRUST_WORKSPACE": "true"}

    def ask(self, prompt: str, resume: bool = False) -> dict:
        """The CLI's JSON result of one `gemini -p` (`--resume latest` for the next turn)."""
        argv = ["gemini", "-m", self.model, *(["--resume", "latest"] if resume else []), "-p", prompt,
                "--output-format", "json"]
        return _json_result(_run(argv, self.env, self.work), "gemini")


def inferred(client: httpx.Client, protocol: str) -> list[dict]:
    """The server's conversations inferred from `protocol`'s stateless clients, described."""
    listing = client.get("/v1/conversations", params={"limit": 1000}).json()["data"]
    return [client.get(f"/v1/conversations/{c['id']}").json() for c in listing if c["inferred"] == protocol]


def cached_share(turn: dict) -> float:
    """The share of a turn's prompt tokens that came from the cache (device or host)."""
    prompt = sum(s["prompt_tokens"] for s in turn["steps"])
    cached = sum((s["cached_input_tokens"] or 0) + s["host_loaded_tokens"] for s in turn["steps"])
    return cached / prompt
