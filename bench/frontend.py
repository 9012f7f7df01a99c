"""The runtime's own cost per step: by conversation length, and steps/s of one process.

    .venv/bin/python bench/frontend.py [--baseline REV] [--turns 300] [--repeats 3] [--duration 10] [--rounds 3] [--concurrency 1,8,32] [--fleet]

Writes bench/results/frontend.json and .png. Upstream mode against a stand-in
provider on loopback that answers at once (its own process), so that only the
runtime's work is timed: the runtime is `session-runtime serve --upstream ...
--data-dir ...` in its own process (SQLite store, as deployed), driven over
HTTP by client threads here.

- `per_turn`: the median step time around turns 10, 100 and 300 (conversations
  of a 300-word system prompt, a 30-word message and an 8-token answer per
  turn, drop policy; `--repeats` per window), the three windows and the
  servers measured side by side, step by step in rotation (target: turn 300
  within 1.5x of turn 10).
- `throughput`: C clients each running 20-turn conversations back to back for
  `--duration` s; steps/s at each C, the median of `--rounds` windows
  alternated between the servers (target: 3x the 90 steps/s measured before
  this work, at each C). Beside it the runtime processes' CPU per step (all
  threads, from /proc): steadier than steps/s on a shared machine, and what
  bounds one process (one GIL).

With `--baseline REV` the same runs go against that commit's runtime too (a
git worktree, the same venv), alternated with this checkout's in one run. With
`--fleet`, one and two processes of this checkout over one PostgreSQL store (a
server started here from Debian's package, tests/postgres.py) are measured
after the SQLite servers, alternated between themselves; agent i talks to process i mod 2, as a round-robin reverse
proxy would send it (target: two processes at least 1.7x one). Each window
also records the whole machine's busy share (/proc/stat): where one process's
windows already keep the machine (its clients, the stand-in and PostgreSQL
with it) busy most of the time, two cannot go much past it; the JSON gives
both processes' busy shares beside the ratio.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))  # tests.postgres
from procstat import machine_ticks, process_cpu_s  # noqa: E402
from report import write_report  # noqa: E402
from session_runtime.direct_http import DirectPool  # noqa: E402

SYSTEM = " ".join(["word"] * 300)
MESSAGE = " ".join(["token"] * 30)
REPLY = {"id": "r", "object": "chat.completion", "created": 0, "model": "m",
         "choices": [{"index": 0, "finish_reason": "stop", "message": {
             "role": "assistant", "content": "Sure, done: six words here.", "reasoning_content": "Think."}}],
         "usage": {"prompt_tokens": 100, "completion_tokens": 8, "total_tokens": 108}}
ANTHROPIC_REPLY = {"id": "msg_r", "type": "message", "role": "assistant", "model": "m",
                   "content": [{"type": "thinking", "thinking": "Think.", "signature": "c2ln"},
                               {"type": "text", "text": "Sure, done: six words here."}],
                   "stop_reason": "end_turn", "stop_sequence": None,
                   "usage": {"input_tokens": 100, "output_tokens": 8}}
WINDOWS = {"10": (5, 15), "100": (95, 105), "300": (290, 300)}


def stand_in() -> None:
    """The provider: answers every POST at once (one write, so no Nagle wait)."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    def answer(reply: dict) -> bytes:
        body = json.dumps(reply).encode()
        return b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (
            len(body), body)

    chat, messages = answer(REPLY), answer(ANTHROPIC_REPLY)

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self):  # noqa: N802
            self.rfile.read(int(self.headers.get("content-length", 0)))
            self.wfile.write(messages if self.path.endswith("/v1/messages") else chat)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    print(server.server_address[1], flush=True)
    server.serve_forever()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Served:
    """A runtime process (this checkout's or a worktree's) in upstream mode."""

    def __init__(self, root: Path, upstream: str, name: str, *flags: str):
        self.name, self.port = name, free_port()
        self.data = tempfile.mkdtemp(prefix=f"frontend-{name}-")
        env = {**os.environ, "PYTHONPATH": str(root)}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "session_runtime.cli", "serve", "--upstream", upstream, "--upstream-model", "m",
             "--data-dir", self.data, "--port", str(self.port), "--max-conversations-per-tenant", "0",
             "--max-tenant-bytes", "0", "--no-access-log", *flags],
            cwd=root, env=env, stdout=subprocess.DEVNULL, stderr=open(f"{self.data}/log", "w"))
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.time() + 180
        while time.time() < deadline:
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.5)
        raise RuntimeError(f"{name}: the runtime did not start; see {self.data}/log")

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=60)


# The client threads share the cores with the servers: they talk HTTP with the
# leanest kept-alive client at hand (the runtime's own, direct_http.py), which
# takes 0.3 ms of CPU per step where httpx took 0.9 (measured against the
# runtime here); httpx was the client before 2026-12-03.
_JSON = {"content-type": "application/json"}
_STEP = json.dumps({"content": MESSAGE, "max_tokens": 8}).encode()
_CREATE = json.dumps({"system": SYSTEM, "policy": "drop"}).encode()


def _post(client: DirectPool, path: str, body: bytes) -> bytes:
    with client.post(path, body, _JSON) as r:
        out = r.read()
        if r.status >= 300:
            raise RuntimeError(f"POST {path}: HTTP {r.status}: {out[:300]!r}")
    return out


def create(client: DirectPool) -> str:
    return json.loads(_post(client, "/v1/conversations", _CREATE))["id"]


def step(client: DirectPool, cid: str) -> float:
    t0 = time.perf_counter()
    _post(client, f"/v1/conversations/{cid}/messages", _STEP)
    return time.perf_counter() - t0


def per_turn(group: dict, turns: int, repeats: int) -> dict:
    """Per server, the median ms of a step in each window of WINDOWS (turns a to
    b), measured side by side: `repeats` conversations per window are first
    taken to turn a (timed, for the plot), then the windows' steps run in
    rotation, one step of each conversation of each server in turn, so a slow
    minute of this machine lands on every window alike. (Measured one
    conversation after another, turn 300 came a minute after turn 10, and one
    commit's ratio moved from 1.41x to 1.75x with the machine.)"""
    windows = {k: w for k, w in WINDOWS.items() if w[1] <= turns}
    clients = {name: DirectPool(s.url, timeout_s=120) for name, s in group.items()}
    try:
        convs, series = {}, {name: [] for name in group}
        for name, c in clients.items():
            for k, (a, _) in windows.items():
                for r in range(repeats):
                    convs[name, k, r] = cid = create(c)
                    ms = [round(step(c, cid) * 1000, 3) for _ in range(a)]
                    series[name] = max(series[name], ms, key=len)
        samples: dict = {(name, k): [] for name in group for k in windows}
        names = list(group)
        for i in range(max(b - a for a, b in windows.values())):
            for k, (a, b) in windows.items():
                for r in range(repeats if a + i < b else 0):
                    for name in names if (i + r) % 2 == 0 else names[::-1]:
                        samples[name, k].append(round(step(clients[name], convs[name, k, r]) * 1000, 3))
    finally:
        for c in clients.values():
            c.close()
    return {name: {"ms": series[name], "runs": repeats, "side_by_side": True,
                   "window_ms": {k: samples[name, k] for k in windows},
                   "median_ms": {k: round(statistics.median(samples[name, k]), 3) for k in windows}}
            for name in group}


def throughput(served, clients: int, duration: float, turns: int = 20) -> dict:
    """Steps/s of `clients` agents; with several processes (a list), agent i talks to process i mod n."""
    fleet = served if isinstance(served, list) else [served]
    counts, stop = [0] * clients, time.perf_counter() + duration

    def agent(i: int) -> None:
        with contextlib.closing(DirectPool(fleet[i % len(fleet)].url, timeout_s=120)) as c:
            while time.perf_counter() < stop:
                cid = create(c)
                for _ in range(turns):
                    if time.perf_counter() >= stop:
                        return
                    step(c, cid)
                    counts[i] += 1

    t0, cpu0, ticks0 = time.perf_counter(), sum(process_cpu_s(s.proc.pid) for s in fleet), machine_ticks()
    threads = [threading.Thread(target=agent, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    steps, cpu = sum(counts), sum(process_cpu_s(s.proc.pid) for s in fleet) - cpu0
    busy, total = (b - a for a, b in zip(ticks0, machine_ticks()))
    return {"steps": steps, "seconds": round(time.perf_counter() - t0, 2),
            "steps_per_s": round(steps / (time.perf_counter() - t0), 1),
            "server_cpu_ms_per_step": round(cpu / max(steps, 1) * 1e3, 3),
            "machine_busy": round(busy / max(total, 1), 3)}


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 4.8))
    for name, part in result["runs"].items():
        if "per_turn" in part:
            line, = a.plot(range(1, len(part["per_turn"]["ms"]) + 1), part["per_turn"]["ms"], ".", ms=2,
                           label=f"{name} (taking conversations to the windows)")
            if part["per_turn"].get("side_by_side"):
                med = part["per_turn"]["median_ms"]
                a.plot([int(k) for k in med], list(med.values()), "D-", color=line.get_color(), ms=7,
                       label=f"{name}: window medians, side by side")
        levels = sorted(part["throughput"], key=int)
        b.plot([int(c) for c in levels], [part["throughput"][c]["steps_per_s"] for c in levels], "o-", label=name)
    a.set(xlabel="turn", ylabel="ms per step (HTTP, instant provider)", yscale="log",
          title="the runtime's time per step by conversation length")
    b.set(xlabel="concurrent clients", ylabel="steps/s", xscale="log",
          title="steps/s, 20-turn conversations (SQLite; PostgreSQL x1, x2)")
    b.axhline(270, color="gray", ls="--", lw=0.8, label="target: 3x 90 steps/s")
    for ax in (a, b):
        ax.legend()
    fig.suptitle(f"bench/frontend.py on {result['machine']['cores']} CPU cores (upstream mode, "
                 f"{result['settings']['protocol']} protocol, stand-in provider)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    if "--stand-in" in sys.argv:
        return stand_in()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", help="a commit to measure beside this checkout (git worktree)")
    ap.add_argument("--turns", type=int, default=300)
    ap.add_argument("--duration", type=float, default=10.0)
    ap.add_argument("--repeats", type=int, default=3, help="conversations per window and server for the per-turn figures")
    ap.add_argument("--rounds", type=int, default=3,
                    help="windows per server and client count, alternated between the servers; the median is reported")
    ap.add_argument("--concurrency", default="1,8,32", help="client counts for steps/s; 'none': per-turn figures only")
    ap.add_argument("--protocol", default="deepseek", choices=["deepseek", "anthropic"],
                    help="the upstream protocol (the stand-in answers both)")
    ap.add_argument("--name", default="frontend")
    ap.add_argument("--fleet", action="store_true",
                    help="also one and two processes over one PostgreSQL store (a server started here)")
    args = ap.parse_args()
    provider = subprocess.Popen([sys.executable, __file__, "--stand-in"], stdout=subprocess.PIPE, text=True)
    upstream = f"http://127.0.0.1:{provider.stdout.readline().strip()}"
    upstream += "/v1" if args.protocol == "deepseek" else ""  # what each provider's SDK takes as base_url
    roots = {"this checkout": ROOT}
    worktree = None
    if args.baseline:
        worktree = Path(tempfile.mkdtemp(prefix="frontend-baseline-")) / "tree"
        subprocess.run(["git", "worktree", "add", "--detach", str(worktree), args.baseline], cwd=ROOT, check=True,
                       capture_output=True)
        roots = {f"baseline {args.baseline}": worktree, **roots}
    servers, fleets, postgres = {}, {}, None
    try:
        servers = {name: Served(root, upstream, name.split()[0], "--upstream-protocol", args.protocol)
                   for name, root in roots.items()}
        runs = {name: {"per_turn": part, "throughput": {}}
                for name, part in per_turn(servers, args.turns, args.repeats).items()}
        if args.fleet:
            from tests.postgres import PostgresServer

            postgres = PostgresServer()
            for n in (1, 2):
                store = ("--store", postgres.new_database())
                fleets[f"postgresql x{n}"] = [Served(ROOT, upstream, f"pg{n}-{i}", *store) for i in range(n)]
        # SQLite's servers first, then PostgreSQL's: each group alternated window by window within
        # itself (PostgreSQL's own background work after a window of writes lands on its group only).
        clients = [int(x) for x in args.concurrency.split(",")] if args.concurrency != "none" else []
        for group in (servers, fleets):
            for c in clients:
                windows: dict = {name: [] for name in group}
                for _ in range(args.rounds):  # a noisy minute hits every server of the group alike
                    for name, s in group.items():
                        windows[name].append(throughput(s, c, args.duration))
                for name, ws in windows.items():
                    rates = [w["steps_per_s"] for w in ws]
                    runs.setdefault(name, {"throughput": {}})["throughput"][str(c)] = {
                        "steps_per_s": statistics.median(rates), "windows": rates,
                        "steps": sum(w["steps"] for w in ws),
                        "server_cpu_ms_per_step": statistics.median(w["server_cpu_ms_per_step"] for w in ws),
                        "machine_busy": statistics.median(w["machine_busy"] for w in ws)}
                    print(name, c, runs[name]["throughput"][str(c)], flush=True)
    finally:
        for s in [*servers.values(), *(p for f in fleets.values() for p in f)]:
            s.close()
        if postgres is not None:
            postgres.stop()
        provider.terminate()
        if worktree is not None:
            subprocess.run(["git", "worktree", "remove", "--force", str(worktree)], cwd=ROOT, capture_output=True)
    ours = runs["this checkout"]
    med = ours["per_turn"]["median_ms"]
    levels_rate = {c: v["steps_per_s"] for c, v in ours["throughput"].items()}
    result = {
        "command": "python bench/frontend.py " + " ".join(sys.argv[1:]),
        "machine": {"cores": os.cpu_count(), "gpu": None, "python": sys.version.split()[0]},
        "git_commit": subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                                     text=True).stdout.strip(),
        "settings": {"protocol": args.protocol, "turns": args.turns, "duration_s": args.duration, "system_words": 300, "message_words": 30,
                     "answer_tokens": 8, "policy": "drop", "store": "SQLite (--data-dir)"},
        "runs": runs,
        "targets": {
            "turn_300_over_turn_10": round(med["300"] / med["10"], 2) if "300" in med else None,
            "turn_300_within_1.5x_of_turn_10": med["300"] <= 1.5 * med["10"] if "300" in med else None,
            "steps_per_s": levels_rate,
            "steps_per_s_at_least_270_at_every_level": bool(levels_rate) and min(levels_rate.values()) >= 270,
        },
        "notes": ("machine_busy: the whole machine's busy share in a window (/proc/stat). "
                  "server, stand-in provider and client threads share this machine's cores; the client's "
                  "HTTP work competes with the runtime's (the client is http.client keep-alive, "
                  "session_runtime/direct_http.py, since 2026-12-03; httpx before). A --baseline runs from its own worktree in this "
                  "checkout's venv: what the venv has (httptools, say) serves it too"),
    }
    if fleets:
        one, two = (runs[f"postgresql x{n}"]["throughput"] for n in (1, 2))
        ratios = {c: round(two[c]["steps_per_s"] / one[c]["steps_per_s"], 2) for c in one}
        result["targets"]["two_over_one_process_postgresql"] = ratios
        result["targets"]["two_processes_at_least_1.7x_one"] = max(ratios.values()) >= 1.7
        # How busy the whole machine was (its clients, the stand-in and PostgreSQL included):
        # two processes cannot go past the cores the one left idle.
        result["targets"]["machine_busy_one_two"] = {c: [one[c]["machine_busy"], two[c]["machine_busy"]] for c in one}
    for name, part in runs.items():
        if "per_turn" in part:
            print(name, "per-turn medians (ms):", part["per_turn"]["median_ms"])
    js, png = write_report(args.name, result, plot)
    print("wrote", js, png)


if __name__ == "__main__":
    main()
