"""HTTP benchmark: requests/s and p50/p99 latency of the session API, and the
server's own overhead per step as a fraction of engine time.

    .venv/bin/python bench/http_api.py [--device cpu|cuda] [--requests 240 | --duration 10]
                                   [--concurrency 1,8,32] [--turns 6]

Writes bench/results/http_api.json and bench/results/http_api.png.

A Runtime and an in-process uvicorn server on loopback (as the tests run it).
At each concurrency C, C threads, each with its own httpx client (keep-alive),
drive their own conversations: POST /v1/conversations/{id}/messages with a
short forced output (reasoning + content, ~10 tokens), `--turns` turns per
conversation, then a new conversation. The same workload (same prompts, same
forced output, fresh conversations so the cache behaves the same) is then run
in-process by C threads calling `runtime.send_message` directly: the
difference is what the HTTP layer (FastAPI, pydantic, JSON, uvicorn, the
threadpool hop, loopback and the httpx client) adds per step.

Overhead is reported three ways (bench/results/http_api.json, `overhead`):
- service: wall time per request (wall / requests) over HTTP minus the same
  in-process, over the in-process figure: what the HTTP layer costs the
  server's sustained rate. HTTP and in-process runs alternate in `--rounds`
  so load from other jobs hits both alike;
- latency_p50: median HTTP latency minus median in-process latency;
- accounting: HTTP wall time per request minus the step's engine time
  estimated from its accounting, ttft_ms + (output_tokens - 1) * tpot_ms,
  over that estimate (this one also counts the runtime's own bookkeeping).
At C > 1 the engine serializes steps, so per-request latency includes queueing.

Client threads and the server share one Python process (and its GIL), so the
HTTP numbers include the client's own cost; on a 2-core machine shared with
other jobs the absolute numbers are noisy (the load average is recorded).
"""

from __future__ import annotations

import sys
from pathlib import Path
import argparse
import os
import platform
import socket
import statistics
import threading
import time

from report import RESULTS, write_report  # noqa: E402  (bench/ is on sys.path when run)
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

FORCED = {"reasoning": "Short thought.", "content": "Short answer."}


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100])."""
    s = sorted(values)
    if not s:
        return float("nan")
    k = max(0, min(len(s) - 1, int(round(q / 100 * len(s) + 0.5)) - 1))
    return s[k]


def summarize(lat_ms: list[float], wall_s: float) -> dict:
    return {
        "requests": len(lat_ms), "wall_s": round(wall_s, 3), "rps": round(len(lat_ms) / wall_s, 2),
        "p50_ms": round(percentile(lat_ms, 50), 3), "p99_ms": round(percentile(lat_ms, 99), 3),
        "mean_ms": round(statistics.fmean(lat_ms), 3),
        "service_ms": round(wall_s / len(lat_ms) * 1e3, 3),  # wall time per request at this concurrency
    }


def start_server(runtime):
    import uvicorn

    from session_runtime.api.app import create_app

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(create_app(runtime), host="127.0.0.1", port=port, log_level="warning",
                                           access_log=False))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.01)
    return server, thread, f"http://127.0.0.1:{port}"


class Budget:
    """Shared request budget: a count, or a deadline."""

    def __init__(self, requests: int, duration: float):
        self.left, self.deadline, self.lock = requests, None, threading.Lock()
        self.duration = duration

    def start(self) -> None:
        if self.duration:
            self.deadline = time.perf_counter() + self.duration

    def take(self) -> bool:
        if self.deadline is not None:
            return time.perf_counter() < self.deadline
        with self.lock:
            if self.left <= 0:
                return False
            self.left -= 1
            return True


def drive(concurrency: int, budget: Budget, turns: int, tag: str, make_worker) -> tuple[list[dict], float]:
    """Run `concurrency` workers until the budget is spent. Each worker gets
    (thread index, take, record). Returns the records and the wall time."""
    records: list[dict] = []
    lock = threading.Lock()
    go = threading.Barrier(concurrency + 1)
    errors: list[BaseException] = []

    def record(r: dict) -> None:
        with lock:
            records.append(r)

    def run(i: int) -> None:
        try:
            make_worker(i, go, budget.take, record)
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)
            go.abort()

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(concurrency)]
    for t in threads:
        t.start()
    go.wait()  # every worker has its conversation ready
    budget.start()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise errors[0]
    return records, wall


def workload(i: int, n: int, turn: int) -> str:
    return f"Thread {i}, conversation {n}, turn {turn}: what is next?"


def http_level(url: str, concurrency: int, budget: Budget, turns: int, tag: str) -> tuple[list[dict], float]:
    import httpx

    def worker(i, go, take, record):
        with httpx.Client(base_url=url, timeout=300) as c:
            def new_conv(n):
                r = c.post("/v1/conversations", json={"system": f"[{tag}] bench thread {i} conversation {n}.",
                                                     "policy": "keep", "materialize": "never"})
                r.raise_for_status()
                return r.json()["id"]

            n, turn, cid = 0, 0, new_conv(0)
            go.wait()
            while take():
                if turn == turns:  # conversation creation is not timed
                    n, turn = n + 1, 0
                    cid = new_conv(n)
                t = time.perf_counter()
                r = c.post(f"/v1/conversations/{cid}/messages",
                           json={"content": workload(i, n, turn), "forced": FORCED})
                lat = (time.perf_counter() - t) * 1e3
                r.raise_for_status()
                record({"latency_ms": lat, "accounting": r.json()["accounting"]})
                turn += 1

    return drive(concurrency, budget, turns, tag, worker)


def inprocess_level(runtime, concurrency: int, budget: Budget, turns: int, tag: str) -> tuple[list[dict], float]:
    def worker(i, go, take, record):
        def new_conv(n):
            return runtime.create_conversation(f"[{tag}] bench thread {i} conversation {n}.", policy="keep",
                                               materialize="never")

        n, turn, cid = 0, 0, new_conv(0)
        go.wait()
        while take():
            if turn == turns:
                n, turn = n + 1, 0
                cid = new_conv(n)
            t = time.perf_counter()
            step = runtime.send_message(cid, workload(i, n, turn), forced=FORCED)
            lat = (time.perf_counter() - t) * 1e3
            record({"latency_ms": lat, "accounting": step.accounting.as_dict()})
            turn += 1

    return drive(concurrency, budget, turns, tag, worker)


def engine_ms(acc: dict) -> float:
    return acc["ttft_ms"] + max(acc["output_tokens"] - 1, 0) * acc["tpot_ms"]


def health_floor(url: str, n: int = 200) -> dict:
    import httpx

    with httpx.Client(base_url=url, timeout=60) as c:
        for _ in range(10):
            c.get("/health")
        lat = []
        t0 = time.perf_counter()
        for _ in range(n):
            t = time.perf_counter()
            c.get("/health").raise_for_status()
            lat.append((time.perf_counter() - t) * 1e3)
    return summarize(lat, time.perf_counter() - t0)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["levels"]
    cs = [r["concurrency"] for r in rows]
    x = range(len(cs))
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    ax = axes[0]
    ax.bar([i - 0.2 for i in x], [r["http"]["rps"] for r in rows], width=0.4, label="HTTP")
    ax.bar([i + 0.2 for i in x], [r["inprocess"]["rps"] for r in rows], width=0.4, label="in-process")
    ax.set_xticks(list(x), [str(c) for c in cs])
    ax.set_xlabel("concurrent conversations")
    ax.set_ylabel("steps / s")
    ax.set_title("Throughput (forced ~10-token outputs)")
    ax.legend()
    ax = axes[1]
    for mode, style in (("http", "-o"), ("inprocess", "--s")):
        ax.plot(cs, [r[mode]["p50_ms"] for r in rows], style, label=f"{mode} p50")
        ax.plot(cs, [r[mode]["p99_ms"] for r in rows], style, alpha=0.5, label=f"{mode} p99")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(cs, [str(c) for c in cs])
    ax.set_xlabel("concurrent conversations")
    ax.set_ylabel("latency per step (ms)")
    ax.set_title("Latency")
    ax.legend(fontsize=8)
    ax = axes[2]
    ax.bar([i - 0.2 for i in x], [100 * r["overhead"]["service_fraction"] for r in rows], width=0.4,
           label="service time vs in-process")
    ax.bar([i + 0.2 for i in x], [100 * r["overhead"]["accounting_fraction"] for r in rows], width=0.4,
           label="service time vs engine time (accounting)")
    ax.set_xticks(list(x), [str(c) for c in cs])
    ax.set_xlabel("concurrent conversations")
    ax.set_ylabel("% of engine time")
    ax.set_title("HTTP layer overhead per step")
    ax.legend(fontsize=8)
    fig.suptitle(f"session API over loopback, {result['device']['device']} ({result['device']['cpu']}), "
                 f"load avg {result['loadavg_1m']['start']:.1f}->{result['loadavg_1m']['end']:.1f}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default=None, choices=["cpu", "cuda"], help="default: cuda if available")
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--concurrency", default="1,8,32", help="comma-separated numbers of concurrent conversations")
    ap.add_argument("--requests", type=int, default=320, help="timed steps per level and mode")
    ap.add_argument("--duration", type=float, default=0.0, help="seconds per level and mode (overrides --requests)")
    ap.add_argument("--turns", type=int, default=6, help="turns per conversation before a new one")
    ap.add_argument("--warmup", type=int, default=16, help="untimed steps before the first level")
    ap.add_argument("--rounds", type=int, default=4, help="alternations of HTTP and in-process runs per level")
    args = ap.parse_args()

    import torch

    from session_runtime.config import RuntimeConfig
    from session_runtime.runtime import Runtime

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    load0 = os.getloadavg()
    t_start = time.perf_counter()
    runtime = Runtime(RuntimeConfig(model=args.model, device=device, page_size=16, pool_tokens=262144,
                                    max_context=4096), background=False)
    server, thread, url = start_server(runtime)
    print(f"server on {url} ({device}), ready in {time.perf_counter() - t_start:.1f}s", flush=True)
    levels = [int(c) for c in args.concurrency.split(",")]
    try:
        http_level(url, 1, Budget(args.warmup, 0), args.turns, "warmup-http")
        inprocess_level(runtime, 1, Budget(args.warmup, 0), args.turns, "warmup-inproc")
        floor = health_floor(url)
        rows = []
        for c in levels:
            # Alternate HTTP and in-process in rounds, so load from other jobs hits both alike.
            http_recs, inp_recs, http_wall, inp_wall = [], [], 0.0, 0.0
            per_round = Budget(max(1, args.requests // args.rounds), args.duration / args.rounds)
            for k in range(args.rounds):
                tag = f"c{c}-r{k}"
                recs, wall = http_level(url, c, Budget(per_round.left, per_round.duration), args.turns, "http-" + tag)
                http_recs += recs
                http_wall += wall
                recs, wall = inprocess_level(runtime, c, Budget(per_round.left, per_round.duration), args.turns,
                                             "inproc-" + tag)
                inp_recs += recs
                inp_wall += wall
            http = summarize([r["latency_ms"] for r in http_recs], http_wall)
            inp = summarize([r["latency_ms"] for r in inp_recs], inp_wall)
            eng_http = statistics.fmean(engine_ms(r["accounting"]) for r in http_recs)
            eng_inp = statistics.fmean(engine_ms(r["accounting"]) for r in inp_recs)
            eng_http_p50 = percentile([engine_ms(r["accounting"]) for r in http_recs], 50)
            row = {
                "concurrency": c, "http": http, "inprocess": inp,
                "engine_ms_mean": {"http_run": round(eng_http, 3), "inprocess_run": round(eng_inp, 3)},
                "engine_ms_p50_http_run": round(eng_http_p50, 3),
                "prefill_ms_mean": round(statistics.fmean(r["accounting"]["prefill_ms"] for r in http_recs), 3),
                "prompt_tokens_mean": round(statistics.fmean(r["accounting"]["prompt_tokens"] for r in http_recs), 1),
                "output_tokens_mean": round(statistics.fmean(r["accounting"]["output_tokens"] for r in http_recs), 1),
                "overhead": {
                    # Per request, medians; at C > 1 latencies include queueing on the engine.
                    "latency_p50_ms": round(http["p50_ms"] - inp["p50_ms"], 3),
                    "latency_p50_fraction": round((http["p50_ms"] - inp["p50_ms"]) / inp["p50_ms"], 4),
                    # Wall time per request: what the server sustains, vs the same steps in-process.
                    "service_ms": round(http["service_ms"] - inp["service_ms"], 3),
                    "service_fraction": round((http["service_ms"] - inp["service_ms"]) / inp["service_ms"], 4),
                    # HTTP wall time per request vs the engine's own time per step (accounting estimate).
                    "accounting_ms": round(http["service_ms"] - eng_http, 3),
                    "accounting_fraction": round((http["service_ms"] - eng_http) / eng_http, 4),
                },
            }
            rows.append(row)
            o = row["overhead"]
            print(f"C={c:3d}  HTTP {http['rps']:6.1f} req/s p50 {http['p50_ms']:7.2f} p99 {http['p99_ms']:7.2f} ms | "
                  f"in-process {inp['rps']:6.1f} steps/s p50 {inp['p50_ms']:7.2f} ms | engine {eng_http:5.2f} ms/step | "
                  f"HTTP adds {o['service_ms']:+.2f} ms/step ({100 * o['service_fraction']:+.0f}% vs in-process, "
                  f"{100 * o['accounting_fraction']:+.0f}% vs engine time)", flush=True)
        runtime.check_integrity()
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        runtime.close()

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor() or platform.machine()) \
        if Path("/proc/cpuinfo").exists() else platform.machine()
    result = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "device": {"device": device, "model": args.model, "cpu": cpu, "cpu_count": os.cpu_count(),
                   "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
                   "gpu": torch.cuda.get_device_name() if device == "cuda" else None,
                   "python": platform.python_version()},
        "loadavg_1m": {"start": load0[0], "end": os.getloadavg()[0]},
        "loadavg": {"start": list(load0), "end": list(os.getloadavg())},
        "workload": {"forced": FORCED, "turns_per_conversation": args.turns, "policy": "keep",
                     "requests_per_level": None if args.duration else args.requests, "rounds": args.rounds,
                     "duration_s_per_level": args.duration or None, "page_size": 16},
        "health_floor": floor,  # GET /health: the bare HTTP round trip
        "levels": rows,
        "wall_s": round(time.perf_counter() - t_start, 1),
        "notes": ("client threads and the uvicorn server share one process and its GIL; HTTP numbers include "
                  "the httpx client's cost. Engine time per step = ttft_ms + (output_tokens-1)*tpot_ms."),
    }
    write_report("http_api", result, plot)
    print(f"wall {result['wall_s']}s -> {RESULTS}/http_api.json, http_api.png", flush=True)


if __name__ == "__main__":
    main()
