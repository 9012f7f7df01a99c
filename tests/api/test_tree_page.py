"""GET /debug/tree.html rendered by headless Chromium against a live server.

The page draws the chains and the tree from GET /debug/tree in the browser, so
the test runs the real page: a uvicorn server in a thread, `chromium
--dump-dom`, and checks on the DOM it produced: the nodes, forks and owners;
after a dropped turn the fork marker and the ghost of the dropped branch with
its size; a tool wait held on the host; the canonical branch; the private
partial page; each step's uncached reasons. Skipped when no Chromium binary
is installed (Debian: `apt-get update && apt-get install -y chromium`; `.ci/run`
installs it).
"""

from __future__ import annotations

import re
import shutil
import socket
import subprocess
import threading
import time
from html.parser import HTMLParser

import httpx
import pytest

APT = "apt-get update && apt-get install -y chromium"
BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
SYSTEM = "You are a careful assistant. Think step by step, and answer in one short sentence. " * 2


def _chromium() -> str:
    for name in BROWSERS:
        path = shutil.which(name)
        if path:
            return path
    pytest.skip(f"no Chromium binary ({', '.join(BROWSERS)}) on PATH; install it with: {APT}")


@pytest.fixture(scope="module")
def browser() -> str:
    return _chromium()


@pytest.fixture(scope="module")
def server():
    """(base url, {'a': id, 'b': id}): two conversations that share a system
    prompt and fork on their first user message.

    Under drop a closed turn's chain moves to its fork (before <think>) and
    the generated branch is freed, so each chain ends at its prompt's fork:
    bos + system (37) + <User> = 39 shared tokens (node 0..32), and each user
    message is long enough (12 and 16 tokens) that both forks (52, 56) reach
    past the next page boundary (48): the shared node has two children."""
    import uvicorn

    from session_runtime.api.app import create_app
    from session_runtime.config import RuntimeConfig
    from session_runtime.runtime import Runtime

    rt = Runtime(RuntimeConfig(model="tiny", page_size=16, pool_tokens=8192, max_context=2048), background=False)
    a = rt.create_conversation(SYSTEM)
    b = rt.create_conversation(SYSTEM)
    rt.send_message(a, "What is the capital of France? Answer in one word.", forced={"reasoning": "It is Paris.", "content": "Paris."})
    # Markup in a message: the page must show it as text, not as elements.
    rt.send_message(b, "Name a prime <b>bigger</b> than ten & say why",
                    forced={"reasoning": "Eleven is prime.", "content": "11"})
    # A tool wait offloaded to the host, and a dropped turn whose canonical branch was built.
    tool = rt.create_conversation("A tool-using agent. " * 6, offload="always")
    rt.send_message(tool, "Look it up.", forced={"reasoning": "I need the tool. " * 5,
                                                 "tool_calls": [{"name": "lookup", "arguments": {"q": "x"}}]})
    assert rt.offload.run_due() > 0
    canonical = rt.create_conversation("A patient agent. " * 6, materialize="always")
    rt.send_message(canonical, "Think, then answer.", forced={"reasoning": "Thinking at length. " * 8,
                                                               "content": "Done."})
    rt.materializer.run_pending()
    sock = socket.socket()  # bound here and handed to uvicorn: no free-port race
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    srv = uvicorn.Server(uvicorn.Config(create_app(rt), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not srv.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}", {"a": a, "b": b, "tool": tool, "canonical": canonical}
    srv.should_exit = True
    thread.join(10)
    sock.close()
    rt.close()


def _dump_dom(browser: str, url: str, tmp_path) -> str:
    cmd = [
        browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync",
        f"--user-data-dir={tmp_path / 'profile'}", "--virtual-time-budget=3000", "--dump-dom", url,
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


class _Dom(HTMLParser):
    """Collects every `div.node` (attributes and inner text) and all tag names."""

    VOID = {"br", "hr", "img", "input", "meta", "link", "wbr", "source", "area", "base", "col", "embed", "track"}

    def __init__(self):
        super().__init__()
        self.nodes: dict[int, dict] = {}
        self.tags: list[str] = []
        self.body: dict = {}
        self._open: list[tuple[str, str, int | None]] = []  # (tag, class, node id when a div.node)

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        a = dict(attrs)
        if tag == "body":
            self.body = a
        if tag in self.VOID:
            return
        nid = None
        if tag == "div" and "node" in (a.get("class") or "").split():
            nid = int(a["data-id"])
            self.nodes[nid] = {"attrs": a, "classes": set(a["class"].split()), "text": "", "owners": []}
        self._open.append((tag, a.get("class") or "", nid))

    def handle_endtag(self, tag):
        if tag in self.VOID:
            return
        while self._open and self._open.pop()[0] != tag:
            pass

    def handle_data(self, data):
        inside = [nid for _, _, nid in self._open if nid is not None]
        if not inside:
            return
        node = self.nodes[inside[-1]]
        node["text"] += data
        if self._open[-1][1] == "owner":
            node["owners"].append(data)


def _parse(html: str) -> _Dom:
    dom = _Dom()
    dom.feed(html)
    return dom


def test_page_is_self_contained_and_sends_security_headers(server):
    base, _ = server
    r = httpx.get(base + "/debug/tree.html")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert "http://" not in r.text and "https://" not in r.text
    # Its only assets are its own, from /debug/, and nothing is inline.
    assert re.findall(r'(?:src|href)="([^"]*)"', r.text) == ["tree.css", "tree.js"]
    assert "<style" not in r.text and "style=" not in r.text and "<script>" not in r.text
    for path, kind in (("tree.html", "text/html"), ("tree.js", "text/javascript"), ("tree.css", "text/css")):
        got = httpx.get(f"{base}/debug/{path}")
        assert got.status_code == 200 and got.headers["content-type"].startswith(kind)
        csp = got.headers["content-security-policy"]
        assert "script-src 'self'" in csp and "frame-ancestors 'none'" in csp and "unsafe" not in csp
        assert got.headers["x-content-type-options"] == "nosniff" and got.headers["x-frame-options"] == "DENY"
    # Every response carries them, an API answer and a refusal included.
    for got in (httpx.get(base + "/debug/tree"), httpx.get(base + "/v1/conversations/nope")):
        assert got.headers["x-content-type-options"] == "nosniff"
        assert got.headers["content-security-policy"] == "default-src 'none'; frame-ancestors 'none'"


def test_tree_page_renders_nodes_forks_and_owners(server, browser, tmp_path):
    base, conv = server
    tree = httpx.get(base + "/debug/tree").json()
    dom = _parse(_dump_dom(browser, base + "/debug/tree.html", tmp_path))

    assert set(dom.nodes) == {n["id"] for n in tree["nodes"]}
    children: dict = {}
    for n in tree["nodes"]:
        children.setdefault(n["parent"], []).append(n["id"])
    for n in tree["nodes"]:
        got = dom.nodes[n["id"]]
        assert got["attrs"]["data-tokens"] == str(n["tokens"])
        assert f"{n['tokens']} tok" in got["text"]
        assert f"hits {n['hit_count']}" in got["text"]
        assert got["attrs"]["data-residency"] == n["residency"]
        assert f"res-{n['residency']}" in got["classes"]
        assert ("locked" in got["classes"]) == (n["lock_count"] > 0)
        assert got["owners"] == list(n["owners"]), (n, got)
        is_fork = len(children.get(n["id"], [])) > 1
        assert ("fork" in got["classes"]) == is_fork
        assert ("fork x" in got["text"]) == is_fork

    # The system prompt is one node both chains lock, and it forks.
    shared = [n for n in tree["nodes"] if set(n["owners"]) == {conv["a"], conv["b"]}]
    assert len(shared) == 1, tree
    node = dom.nodes[shared[0]["id"]]
    assert {"fork", "locked"} <= node["classes"]
    assert f"fork x{len(children[shared[0]['id']])}" in node["text"]

    # The user's markup is text: escaped in the DOM, no <b> element.
    assert "b" not in dom.tags
    assert any("<b>bigger" in n["text"] for n in dom.nodes.values())
    # Auto-refresh is on by default: the 2 s timer fetched again within the 3 s budget.
    assert int(dom.body["data-fetches"]) >= 2


def test_conversation_filter_and_refresh_off(server, browser, tmp_path):
    base, conv = server
    for key in ("a", "b"):
        cid = conv[key]
        tree = httpx.get(base + "/debug/tree", params={"conversation": cid}).json()
        dom = _parse(_dump_dom(browser, f"{base}/debug/tree.html?conversation={cid}&refresh=0", tmp_path))
        # The page filters in the browser; it shows exactly the server's filtered set.
        assert set(dom.nodes) == {n["id"] for n in tree["nodes"]} != set()
        assert all(cid in n["owners"] for n in dom.nodes.values())
        assert dom.body["data-fetches"] == "1"


class _Chains(HTMLParser):
    """Every element inside each `div.chain`: (classes, attributes, text)."""

    def __init__(self):
        super().__init__()
        self.chains: dict[str, list[dict]] = {}
        self._stack: list[tuple[str, dict | None]] = []  # (tag, element record)
        self._chain: list[str] = []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        classes = set((a.get("class") or "").split())
        record = None
        if tag == "div" and "chain" in classes:
            self._chain.append(a["data-id"])
            self.chains[a["data-id"]] = []
        elif self._chain:
            record = {"tag": tag, "classes": classes, "attrs": a, "text": ""}
            self.chains[self._chain[-1]].append(record)
        if tag not in _Dom.VOID:
            self._stack.append((tag, record, "chain" in classes and tag == "div"))

    def handle_endtag(self, tag):
        if tag in _Dom.VOID:
            return
        while self._stack:
            t, _, is_chain = self._stack.pop()
            if is_chain:
                self._chain.pop()
            if t == tag:
                break

    def handle_data(self, data):
        for _, record, _ in self._stack:
            if record is not None:
                record["text"] += data


def _chains(html: str) -> dict[str, list[dict]]:
    parser = _Chains()
    parser.feed(html)
    return parser.chains


def _with(elements: list[dict], cls: str) -> list[dict]:
    return [e for e in elements if cls in e["classes"]]


def test_chains_show_the_fork_the_ghost_the_host_and_the_canonical_branch(server, browser, tmp_path):
    base, conv = server
    tree = httpx.get(base + "/debug/tree").json()
    views = {c["id"]: c for c in tree["conversations"]}
    chains = _chains(_dump_dom(browser, base + "/debug/tree.html?refresh=0", tmp_path))
    assert set(chains) == set(views) == set(conv.values())

    # A dropped turn: its fork point is marked where the chain is held to, and the
    # branch it dropped is drawn past it as a ghost with its size, freed.
    a = chains[conv["a"]]
    turn = views[conv["a"]]["turns"][0]
    fork = _with(a, "fork-point")
    assert [(e["attrs"]["data-at"], e["attrs"]["data-turn"]) for e in fork] == [(str(turn["fork"]), "0")]
    assert "fork t0" in fork[0]["text"]
    ghost = _with(a, "ghost")
    assert len(ghost) == 1 and ghost[0]["attrs"]["data-dropped"] == str(turn["dropped"]) != "0"
    assert (ghost[0]["attrs"]["data-from"], ghost[0]["attrs"]["data-to"]) == (
        str(turn["fork"]), str(turn["fork"] + turn["dropped"]))
    assert f"dropped {turn['dropped']} tok (freed)" in ghost[0]["text"]
    # The chain's private partial page: the fork lies inside a page.
    private = _with(a, "private")
    assert private and private[0]["attrs"]["data-to"] == str(views[conv["a"]]["device_tokens"])
    # Each step's uncached tokens, by reason.
    assert {e["attrs"]["data-reason"] for e in _with(a, "reason")} == {"new_input", "first_seen"}

    # A tool wait offloaded to the host shows as held there, not as nothing.
    tool = views[conv["tool"]]
    assert tool["state"] == "tool_wait" and tool["host_tokens"] > 0
    host = _with(chains[conv["tool"]], "host")
    assert len(host) == 1 and f"on the host {tool['host_tokens']} tok" in host[0]["text"]
    assert any(f"{tool['host_tokens']} tok on the host" in e["text"] for e in chains[conv["tool"]])

    # The canonical branch, after the fork, with when it was built.
    built = _with(chains[conv["canonical"]], "canonical")
    assert len(built) == 1 and "canonical branch, built" in built[0]["text"]
    assert views[conv["canonical"]]["turns"][0]["canonical"]["prefill_tokens"] > 0

    # Special tokens are labelled chips in plain ASCII, not boxes.
    html = _dump_dom(browser, base + "/debug/tree.html?refresh=0", tmp_path)
    assert '<span class="chip" title="<｜User｜>">User</span>' in html.replace("&lt;", "<").replace("&gt;", ">")
