"""Faults under agent traffic (issue 42): nothing acknowledged is lost, and how
long each fault keeps its conversations from answering.

    .venv/bin/python bench/faults.py [--duration 600] [--agents 32] [--seed 0]

On this machine, loopback only, stopping by itself: two SGLang servers (the
tiny random Qwen3 shape, CPU, started here and given to the runtimes by URL)
and two `session-runtime serve` processes over one PostgreSQL database (a
fleet: each conversation has one owner, the other relays to it). `--agents`
agents, a third each on the session API, Chat with `conversation_id` and
stateless Messages (the whole history each request, as a harness sends it),
half on each runtime process, step until the end, retrying a 502/503/504 or a
refused connection every 0.5 s (Messages: a 529) (an agent whose process is down goes to the
other one). At random times (each in its own fifth of the run) a worker, a
runtime process and PostgreSQL are each killed (SIGKILL of the process group;
PostgreSQL stopped `immediate`) and started again (the worker and the
runtime at once, on the same port; PostgreSQL after 5 s).

Counted: every acknowledged step (HTTP 200), by the user message it sent;
afterwards each conversation's stored trace (read from a live process) must
hold every one of them in order (lost = acknowledged but not stored; extra =
stored but never acknowledged: a step whose answer the fault took);
non-retryable answers (anything but 200, 502, 503, 504 and Messages' 529); and each fault's
recovery: for each agent that failed after the fault, the seconds from the
fault to its first 200. Targets: 0 lost, 0 non-retryable, recovery p99 at most
5 s after a worker or runtime death.

Writes bench/results/faults.json and .png (steps/s over time, the faults marked).
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from report import write_report  # noqa: E402  (bench/ is on sys.path when run)

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

RETRYABLE = (502, 503, 504, 529)  # 529: Anthropic's "overloaded", its SDK retries it
PROTOCOLS = ("session", "chat", "messages")
CONTEXT = 4096


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def model_folder(root: Path) -> Path:
    """The tiny shape as a random-weight Qwen3 folder (the suite's own)."""
    folder = root / "tiny-qwen3"
    if not (folder / "config.json").exists():
        from tests.conftest import SGLANG_CONTEXT, TINY_SHAPE, _hf_model

        _hf_model("qwen3", seed=4321, shape={**TINY_SHAPE, "max_position_embeddings": SGLANG_CONTEXT}) \
            .save_pretrained(folder, safe_serialization=True)
    return folder


class Worker:
    """An SGLang server started here, on a port of its own for its whole life."""

    def __init__(self, folder: Path, log: Path):
        from session_runtime.backends.sglang.launcher import LaunchSpec

        self.spec = LaunchSpec(model_path=str(folder), page_size=1, max_total_tokens=32768, dtype="float32",
                               device="cpu", context_length=CONTEXT, port=free_port(), log_path=str(log), threads=1,
                               max_running_requests=32)
        self.server = None
        self.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.spec.port}"

    def start(self) -> None:
        from session_runtime.backends.sglang.launcher import launch

        self.server = launch(self.spec, lambda url: _answers(url + "/health"))

    def kill(self) -> None:
        os.killpg(self.server.process.pid, signal.SIGKILL)
        self.server.stop()

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()


class RuntimeProcess:
    """`session-runtime serve` over both workers and the store, on a port of its own."""

    def __init__(self, folder: Path, workers: list[Worker], store: str, data: Path, log: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.argv = [sys.executable, "-m", "session_runtime.cli", "serve", "--backend", "sglang",
                     "--sglang-url", ",".join(w.url for w in workers), "--model", str(folder), "--template",
                     "deepseek", "--page-size", "1", "--pool-tokens", "32768", "--max-context", str(CONTEXT),
                     "--store", store, "--advertise-url", self.url, "--data-dir", str(data), "--port",
                     str(self.port), "--served-model-name", MODEL, "--max-conversations-per-tenant", "0", "--no-access-log"]
        self.log = log
        self.proc = None
        self.start()

    def start(self) -> None:
        self.proc = subprocess.Popen(self.argv, stdout=open(self.log, "a"), stderr=subprocess.STDOUT, cwd=ROOT,
                                     start_new_session=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
        deadline = time.monotonic() + 600
        while not _answers(self.url + "/health"):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"serve did not start: see {self.log}")
            time.sleep(0.5)

    def kill(self) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=5.0).status_code == 200
    except httpx.HTTPError:
        return False


class Agent:
    """One agent: its conversations one after another (a new one every
    STEPS_PER_CONVERSATION steps, so the context stays bounded), what it sent
    and what was acknowledged."""

    def __init__(self, index: int, protocol: str, runtimes: list[RuntimeProcess], rng: random.Random):
        self.index, self.protocol, self.runtimes, self.rng = index, protocol, runtimes, rng
        self.home = index % len(runtimes)
        self.conversations: list[dict] = []  # {"cids": set of ids, "acked": [user message, ...]}
        self.acked: list[float] = []  # when each step was acknowledged
        self.failures: list[tuple[float, int, str]] = []  # (time, status or 0 for no connection, text)
        self.refused: list[tuple[float, int, str]] = []

    def _post(self, http: httpx.Client, path: str, body: dict) -> httpx.Response | None:
        """One try at the agent's process; None (and the other process next) when it cannot be reached."""
        try:
            return http.post(self.runtimes[self.home].url + path, json=body)
        except httpx.HTTPError as exc:
            self.failures.append((time.monotonic(), 0, type(exc).__name__))
            self.home = (self.home + 1) % len(self.runtimes)
            return None

    def _answered(self, http, path: str, body: dict, stop: threading.Event) -> httpx.Response | None:
        """The first answer that is not a retryable failure (None once stopped)."""
        while not stop.is_set():
            r = self._post(http, path, body)
            if r is not None and r.status_code not in RETRYABLE:
                if r.status_code not in (200, 201):
                    self.refused.append((time.monotonic(), r.status_code, r.text[:200]))
                return r
            if r is not None:
                self.failures.append((time.monotonic(), r.status_code, r.text[:200]))
            time.sleep(0.5)
        return None

    def run(self, stop: threading.Event) -> None:
        with httpx.Client(timeout=120) as http:
            while not stop.is_set():
                self._conversation(http, stop)

    def _conversation(self, http: httpx.Client, stop: threading.Event) -> None:
        system = f"Agent {self.index}, conversation {len(self.conversations)}. " * 8
        conv: dict = {"cids": set(), "acked": []}
        if self.protocol in ("session", "chat"):
            r = self._answered(http, "/v1/conversations", {"system": system}, stop)
            if r is None or r.status_code != 201:
                time.sleep(0.5)
                return
            conv["cids"].add(r.json()["id"])
        self.conversations.append(conv)
        history: list[dict] = []
        for k in range(STEPS_PER_CONVERSATION):
            text = f"agent {self.index} step {k}: " + " ".join(self.rng.choice(WORDS) for _ in range(12))
            if self.protocol == "session":
                path, body = f"/v1/conversations/{next(iter(conv['cids']))}/messages", {"content": text,
                                                                                      "max_tokens": 8}
            elif self.protocol == "chat":
                path, body = "/v1/chat/completions", {"model": MODEL, "conversation_id": next(iter(conv["cids"])),
                                                      "max_tokens": 8,
                                                      "messages": [{"role": "user", "content": text}]}
            else:
                path, body = "/v1/messages", {"model": MODEL, "max_tokens": 8, "system": system,
                                              "messages": [*history, {"role": "user", "content": text}]}
            r = self._answered(http, path, body, stop)
            if r is None:
                return
            if r.status_code != 200:
                time.sleep(0.5)
                continue
            self.acked.append(time.monotonic())
            conv["acked"].append(text)
            if self.protocol == "messages":
                conv["cids"].add(r.headers["x-session-runtime-conversation"])
                history += [{"role": "user", "content": text},
                            {"role": "assistant", "content": r.json()["content"] or "(empty)"}]


MODEL = "m"
STEPS_PER_CONVERSATION = 24
WORDS = ("read", "the", "file", "then", "run", "tests", "fix", "bug", "in", "parser", "and", "commit", "check",
         "logs", "for", "errors", "open", "module", "list", "tools")


def stored_users(runtimes: list[RuntimeProcess], cid: str) -> list[str]:
    for rp in runtimes:
        try:
            r = httpx.get(f"{rp.url}/v1/conversations/{cid}", timeout=60)
        except httpx.HTTPError:
            continue
        if r.status_code == 200:
            return [m["content"] for m in r.json()["trace"] if m["role"] == "user"]
    return []  # no process serves it: everything acknowledged in it is lost


def in_order(acked: list[str], stored: list[str]) -> tuple[int, int]:
    """(acknowledged messages not found in order in `stored`, stored user
    messages never acknowledged)."""
    at, found = 0, 0
    for text in acked:
        try:
            at = stored.index(text, at) + 1
            found += 1
        except ValueError:
            pass
    return len(acked) - found, len(stored) - found


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=600.0, help="seconds of traffic (default 600)")
    ap.add_argument("--agents", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--name", default="faults")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    from tests.postgres import PostgresServer

    work = Path(tempfile.mkdtemp(prefix="faults-"))
    folder = model_folder(work)
    pg = PostgresServer()
    workers: list[Worker] = []
    runtimes: list[RuntimeProcess] = []
    t_setup = time.monotonic()
    try:
        store = pg.new_database()
        workers = [Worker(folder, work / f"sglang-w{i}.log") for i in range(2)]
        data = work / "data"
        runtimes = [RuntimeProcess(folder, workers, store, data, work / f"serve-{i}.log") for i in range(2)]
        setup_s = time.monotonic() - t_setup
        print(f"up in {setup_s:.0f} s: workers {[w.url for w in workers]}, runtimes {[r.url for r in runtimes]}; "
              f"logs in {work}", flush=True)
        agents = [Agent(i, PROTOCOLS[i % 3], runtimes, random.Random(rng.random())) for i in range(args.agents)]
        stop = threading.Event()
        threads = [threading.Thread(target=a.run, args=(stop,), daemon=True) for a in agents]
        t0 = time.monotonic()
        for t in threads:
            t.start()
        slots = rng.sample(range(1, 4), 3)  # each fault in its own fifth of the run (the 2nd to the 4th)
        plan = sorted((t0 + (slot + rng.random()) * args.duration / 5, kind)
                      for slot, kind in zip(slots, ("worker", "runtime", "postgres")))
        faults = []
        for at, kind in plan:
            time.sleep(max(0.0, at - time.monotonic()))
            fault = {"kind": kind, "t": time.monotonic() - t0}
            if kind == "worker":
                victim = rng.randrange(len(workers))
                workers[victim].kill()
                fault["victim"] = workers[victim].url
                workers[victim].start()  # the runtimes see it back through their health checks
            elif kind == "runtime":
                victim = rng.randrange(len(runtimes))
                runtimes[victim].kill()
                fault["victim"] = runtimes[victim].url
                runtimes[victim].start()
            else:
                pg.crash()
                time.sleep(5.0)
                pg.start()
            fault["restarted_after_s"] = time.monotonic() - t0 - fault["t"]
            print(f"{fault['t']:6.1f} s: {kind} killed, back after {fault['restarted_after_s']:.1f} s", flush=True)
            faults.append(fault)
        time.sleep(max(0.0, t0 + args.duration - time.monotonic()))
        stop.set()
        for t in threads:
            t.join(150)
        end = time.monotonic()
        result = summarize(args, agents, runtimes, faults, t0, end, setup_s)
    finally:
        for rp in runtimes:
            rp.stop()
        for w in workers:
            w.stop()
        pg.stop()
    js, png = write_report(args.name, result, plot)
    print({k: result[k] for k in ("acknowledged_steps", "lost", "extra", "non_retryable", "targets")})
    print(f"wrote {js} and {png}")


def summarize(args, agents: list[Agent], runtimes, faults: list[dict], t0: float, end: float, setup_s: float) -> dict:
    lost = extra = 0
    per_protocol: dict[str, dict] = {p: {"agents": 0, "conversations": 0, "acknowledged": 0, "lost": 0,
                                         "extra": 0} for p in PROTOCOLS}
    split = 0  # stateless conversations whose requests were matched to more than one stored conversation
    for a in agents:
        row = per_protocol[a.protocol]
        row["agents"] += 1
        for conv in a.conversations:
            if not conv["acked"]:
                continue
            row["conversations"] += 1
            row["acknowledged"] += len(conv["acked"])
            split += len(conv["cids"]) > 1
            # A stateless one split by a fault: the longest stored conversation holds what came after the split.
            stored = max((stored_users(runtimes, cid) for cid in conv["cids"]), key=len)
            n_lost, n_extra = in_order(conv["acked"], stored)
            if len(conv["cids"]) > 1:
                n_lost, n_extra = 0, 0  # counted under split instead
            row["lost"] += n_lost
            row["extra"] += n_extra
            lost, extra = lost + n_lost, extra + n_extra
    recoveries = []
    for f in faults:
        at = t0 + f["t"]
        times = []
        for a in agents:
            if any(at <= t <= at + 60 for t, *_ in a.failures):
                after = [t for t in a.acked if t > at]
                times.append((min(after) - at) if after else None)
        done = [t for t in times if t is not None]
        recoveries.append({**f, "affected_agents": len(times), "never_recovered": len(times) - len(done),
                           "recovery_p50_s": pct(done, 0.5), "recovery_p99_s": pct(done, 0.99),
                           "recovery_max_s": max(done, default=None)})
    bucket = 5.0
    counts = [0] * (int((end - t0) // bucket) + 1)
    for a in agents:
        for t in a.acked:
            counts[min(len(counts) - 1, int((t - t0) // bucket))] += 1
    non_retryable = [(round(t - t0, 1), a.protocol, s, txt) for a in agents for t, s, txt in a.refused]
    deaths = [r["recovery_p99_s"] for r in recoveries if r["kind"] in ("worker", "runtime")]
    return {
        "machine": "this 2-core CPU, loopback; tiny random Qwen3 shape on SGLang's CPU path",
        "duration_s": end - t0, "setup_s": setup_s, "agents": len(agents), "seed": args.seed,
        "acknowledged_steps": sum(len(a.acked) for a in agents), "lost": lost, "extra": extra,
        "stateless_conversations_split": split,
        "non_retryable": len(non_retryable), "non_retryable_samples": non_retryable[:10],
        "per_protocol": per_protocol,
        "faults": recoveries, "steps_per_s": {"bucket_s": bucket, "values": [c / bucket for c in counts]},
        "targets": {"lost_0": lost == 0, "non_retryable_0": not non_retryable,
                    "death_recovery_p99_at_most_5s": all(p is not None and p <= 5.0 for p in deaths)},
    }


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(11, 4))
    s = result["steps_per_s"]
    xs = [i * s["bucket_s"] for i in range(len(s["values"]))]
    ax.plot(xs, s["values"], color="tab:blue", label="acknowledged steps/s")
    colors = {"worker": "tab:red", "runtime": "tab:purple", "postgres": "tab:green"}
    for f in result["faults"]:
        p99 = f["recovery_p99_s"]
        ax.axvline(f["t"], color=colors[f["kind"]], linestyle="--",
                   label=f"{f['kind']} killed (recovery p99 {p99:.1f} s)" if p99 is not None else f["kind"])
    ax.set_xlabel("seconds")
    ax.set_ylabel("steps/s")
    ax.set_title(f"{result['agents']} agents, {result['acknowledged_steps']} acknowledged steps, "
                 f"{result['lost']} lost, {result['non_retryable']} non-retryable")
    ax.legend(loc="lower left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
