"""The README runs as pasted: its Python snippet, and its tour.

The tour is every ```bash block under the README's "## Tour" heading. The
blocks that talk to a server (they use `$SR`, `SR=${SR:-http://localhost:8000}`
in the first one) run in one bash process, so that the shell variables they
set (`CID`, `CALL`) carry from block to block, against a server started in
this process as tests/api/conftest.py starts its own (a Runtime, with its
background materializer as `make serve` has it, under uvicorn on a free
loopback port). The replay block needs no server: it runs meanwhile, in its
own process, from the repository root as the README says.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"


def test_python_snippet_runs(capsys):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    assert blocks, "the README has no Python snippet"
    exec(compile(blocks[0], "README.md", "exec"), {"__name__": "readme"})
    out = capsys.readouterr().out
    assert out.strip(), "the snippet prints what it shows"


def tour_blocks() -> list[str]:
    """The ```bash blocks of the README's "## Tour" section, in order."""
    text = README.read_text()
    start = text.index("\n## Tour\n")
    end = text.find("\n## ", start + 1)
    section = text[start:end if end != -1 else len(text)]
    return re.findall(r"```bash\n(.*?)```", section, re.S)


def test_readme_links_stay_inside_the_repository():
    """Every link of the README and docs/ names a file of the repository;
    none leads outside it, nor to the web."""
    for page in [README, *sorted(DOCS.glob("*.md"))]:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            assert not target.startswith(("http://", "https://")), (page.name, target)
            file, _, anchor = target.partition("#")
            path = (page.parent / file).resolve() if file else page
            assert path.is_relative_to(ROOT), (page.name, target)
            assert path.exists(), (page.name, target)
            if anchor:
                assert anchor in anchors(path), (page.name, target)


def anchors(page: Path) -> set[str]:
    """The anchors of a Markdown page's headings, as GitHub makes them."""
    out = set()
    for heading in re.findall(r"^#+ (.*)$", re.sub(r"```.*?```", "", page.read_text(), flags=re.S), re.M):
        out.add(re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-"))
    return out


def test_tour_runs():
    from session_runtime.config import RuntimeConfig
    from session_runtime.runtime import Runtime
    from tests.api.conftest import start_server

    blocks = tour_blocks()
    assert len(blocks) == 6, "the tour's six steps, (a) to (f)"
    assert blocks[0].startswith("SR=${SR:-http://localhost:8000}\n")
    served = [b for b in blocks if "session-runtime replay" not in b]
    (replay_block,) = [b for b in blocks if "session-runtime replay" in b]

    replay = subprocess.Popen(["bash", "-eo", "pipefail", "-c", replay_block], cwd=ROOT, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        rt = Runtime(RuntimeConfig(model="tiny", page_size=16, pool_tokens=16384, data_dir=None))
        live = None
        try:
            live = start_server(rt)
            run = subprocess.run(["bash", "-eo", "pipefail", "-c", "\n".join(served)], cwd=ROOT, text=True,
                                 capture_output=True, timeout=300, env={**os.environ, "SR": live.url})
            assert run.returncode == 0, run.stdout + run.stderr
            out = run.stdout
            lines = out.splitlines()

            # (a) the conversation exists, with its tool
            cid = re.search(r"^conversation (\w+)$", out, re.M).group(1)
            conv = rt.describe(cid)
            assert [t["function"]["name"] for t in conv["tools"]] == ["get_weather"]

            # (b) the forced output is a tool call, parsed back with an id
            (calls_line,) = [line for line in lines if line.startswith("tool_calls ")]
            (call,) = json.loads(calls_line[len("tool_calls "):])
            assert call["name"] == "get_weather" and call["arguments"] == {"city": "Paris"} and call["id"]

            # (c) the tool result answered that very call: the turn's second step,
            # which continued the chain
            m = re.search(r"^turn 0 step 1 (\w+) cached (\d+) prefilled (\d+)$", out, re.M)
            assert m and int(m.group(2)) > 0, out
            tool_messages = [msg for msg in conv_history(rt, cid) if msg.get("role") == "tool"]
            assert [msg["tool_call_id"] for msg in tool_messages] == [call["id"]]

            # (d) turn 2 and its accounting
            assert re.search(r"^turn 1 length ", out, re.M), out
            fields = dict(line.split(" ", 1) for line in lines if line.split(" ", 1)[0] in (
                "cache_state", "prompt_tokens", "cached_input_tokens", "uncached_prefill_tokens",
                "recomputed_history_tokens"))
            assert fields["cache_state"] in ("prefix_only", "generated_branch", "canonical_branch"), fields
            assert int(fields["cached_input_tokens"]) > 0
            assert int(fields["uncached_prefill_tokens"]) < int(fields["prompt_tokens"])
            for policy in ("keep", "drop"):
                assert any(line.startswith(f"counterfactual {policy} {{'prompt_tokens'") for line in lines), out
            turns = rt.describe(cid)["turns"]
            assert len(turns) == 2 and turns[1]["steps"][0]["cached_input_tokens"] == int(fields["cached_input_tokens"])

            # (e) the tree: this conversation's chain and nodes
            assert re.search(rf"^chains .*'{cid}': \d+", out, re.M), out
            assert live.runtime is rt
            import httpx
            page = httpx.get(f"{live.url}/debug/tree.html", timeout=30)
            assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        finally:
            if live is not None:
                live.stop()
            rt.close()

        # (f) the replay of one shipped sample
        replay_out, _ = replay.communicate(timeout=600)
    finally:
        if replay.poll() is None:
            replay.kill()
            replay.wait()
    assert replay.returncode == 0, replay_out
    assert re.search(r"^\s+2\s.*\bcanonical_branch\b", replay_out, re.M), replay_out
    assert re.search(r"^request-path prefill \d+ \(turn starts \d+ \+ tool steps \d+\)", replay_out, re.M), replay_out


def conv_history(rt, cid: str) -> list[dict]:
    return rt.describe(cid)["history"]
