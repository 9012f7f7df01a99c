"""Operations under load: what an operator and a second client see while the
embedded engine runs a long generation, and the server's memory over rejected
large bodies.

    .venv/bin/python bench/operations.py [--device cpu|cuda] [--long-tokens 1000] [--probes 40]

Writes bench/results/operations.json and bench/results/operations.png.

`session-runtime serve` runs as its own process (the tiny preset, the embedded
engine), driven over loopback from this one:
- idle: latency of GET /health, /metrics, /debug/tree, a conversation's GET,
  and of a 1-token step on another conversation;
- busy: the same, measured while one request generates `--long-tokens` tokens
  (the engine hands its lock over after every token, so these wait at most one
  forward, and operator reads at most 50 ms before answering from the last
  consistent read);
- memory: the server's resident set before and after 20 rejected 10 MB
  bodies (over --max-body-bytes: 413 unread), then after each of three blocks
  of 20 distinct rejected 3.9 MB messages (within the body limit, over the
  context: tokenized, then 413; no memo keeps them, so a level RSS after the
  first block is the allocator keeping freed pages, not growth per message).
"""

from __future__ import annotations

import argparse
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from report import write_report  # noqa: E402  (bench/ is on sys.path when run)

ROUTES = ("/health", "/metrics", "/debug/tree", "conversation")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(port: int, device: str, data_dir: str) -> subprocess.Popen:
    root = Path(__file__).resolve().parent.parent
    proc = subprocess.Popen([sys.executable, "-m", "session_runtime.cli", "serve", "--port", str(port),
                             "--device", device, "--data-dir", data_dir, "--max-context", "4096",
                             "--pool-tokens", "16384", "--no-access-log"], cwd=root, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    for line in proc.stdout:
        if "listening on" in line:
            return proc
    raise RuntimeError("the server did not start")


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _summary(ms: list[float]) -> dict:
    s = sorted(ms)
    return {"n": len(s), "p50_ms": round(statistics.median(s), 1), "p95_ms": round(s[int(0.95 * (len(s) - 1))], 1),
            "max_ms": round(s[-1], 1)}


def _probe(c: httpx.Client, url: str, cid: str, short: str, probes: int, stop: threading.Event | None) -> dict:
    """Latency of each operator route and of a 1-token step, `probes` times (or
    until `stop` is set)."""
    lat: dict[str, list[float]] = {r: [] for r in (*ROUTES, "1-token step")}
    for _ in range(probes):
        if stop is not None and stop.is_set():
            break
        for route in ROUTES:
            path = f"/v1/conversations/{cid}" if route == "conversation" else route
            t0 = time.perf_counter()
            assert c.get(url + path).status_code == 200
            lat[route].append((time.perf_counter() - t0) * 1e3)
        t0 = time.perf_counter()
        r = c.post(f"{url}/v1/conversations/{short}/messages", json={"content": "One word.", "max_tokens": 1})
        assert r.status_code == 200, r.text
        lat["1-token step"].append((time.perf_counter() - t0) * 1e3)
        time.sleep(0.05)
    return {k: _summary(v) for k, v in lat.items() if v}


def run(device: str, long_tokens: int, probes: int, data_dir: str) -> dict:
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    proc = _serve(port, device, data_dir)
    try:
        with httpx.Client(timeout=600) as c:
            long_cid = c.post(f"{url}/v1/conversations", json={"system": "Long."}).json()["id"]
            short = c.post(f"{url}/v1/conversations", json={"system": "Short."}).json()["id"]
            c.post(f"{url}/v1/conversations/{long_cid}/messages", json={"content": "Warm up.", "max_tokens": 4})
            idle = _probe(c, url, long_cid, short, probes, None)

            done, out = threading.Event(), {}

            def long_step() -> None:
                t0 = time.perf_counter()
                with httpx.Client(timeout=600) as c2:
                    r = c2.post(f"{url}/v1/conversations/{long_cid}/messages",
                                json={"content": "Write a lot.", "max_tokens": long_tokens})
                out["status"], out["s"] = r.status_code, time.perf_counter() - t0
                out["tokens"] = r.json()["accounting"]["output_tokens"] if r.status_code == 200 else 0
                done.set()

            t = threading.Thread(target=long_step)
            t.start()
            time.sleep(1.0)  # well inside the generation
            busy = _probe(c, url, long_cid, short, probes, done)
            t.join()

            rss0 = _rss_mb(proc.pid)
            big = b'{"content": "' + b"x" * (10 << 20) + b'"}'
            for _ in range(20):
                assert c.post(f"{url}/v1/conversations/{short}/messages", content=big,
                              headers={"content-type": "application/json"}).status_code == 413
            rss_bodies = _rss_mb(proc.pid)
            rss_messages = []
            for block in range(3):  # 3 x 20 distinct ones: does it grow per message, or level off?
                for i in range(20):
                    text = f"{block} {i} " + "word " * 780_000  # 3.9 MB: under the body limit, over the context
                    r = c.post(f"{url}/v1/conversations/{short}/messages", json={"content": text})
                    assert r.status_code == 413
                rss_messages.append(round(_rss_mb(proc.pid), 1))
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    return {
        "device": device, "long_tokens": long_tokens, "long_step": out,
        "idle": idle, "busy": busy,
        "memory_mb": {"before": round(rss0, 1), "after_20_rejected_10mb_bodies": round(rss_bodies, 1),
                      **{f"after_{20 * (k + 1)}_rejected_3.9mb_messages": v for k, v in enumerate(rss_messages)}},
        "machine": {"cpus": os.cpu_count(), "load_avg": os.getloadavg(), "python": platform.python_version()},
        "notes": ("session-runtime serve in its own process, tiny preset, embedded engine; client over loopback. "
                  "busy = while one request generates long_tokens tokens."),
    }


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 4.8))
    names = list(result["idle"])
    x = range(len(names))
    for off, phase in ((-0.2, "idle"), (0.2, "busy")):
        p50 = [result[phase][n]["p50_ms"] for n in names]
        p95 = [result[phase][n]["p95_ms"] for n in names]
        a.bar([i + off for i in x], p95, width=0.4, alpha=0.35, label=f"{phase} p95")
        a.bar([i + off for i in x], p50, width=0.4, label=f"{phase} p50")
    a.set_xticks(list(x), names, rotation=20)
    a.set_ylabel("latency (ms)")
    a.set_title(f"while a {result['long_tokens']}-token generation runs ({result['device']})")
    a.legend()
    mem = result["memory_mb"]
    b.bar(list(mem), list(mem.values()))
    b.set_ylabel("server RSS (MB)")
    b.set_title("memory over rejected large inputs")
    b.tick_params(axis="x", rotation=15)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--long-tokens", type=int, default=1000)
    ap.add_argument("--probes", type=int, default=40)
    args = ap.parse_args()
    import tempfile

    with tempfile.TemporaryDirectory() as data_dir:
        result = run(args.device, args.long_tokens, args.probes, data_dir)
    js, png = write_report("operations", result, plot)
    for phase in ("idle", "busy"):
        print(phase, {k: v["p50_ms"] for k, v in result[phase].items()})
    print("memory", result["memory_mb"], "->", js, png)


if __name__ == "__main__":
    main()
