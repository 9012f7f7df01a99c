"""Launch SGLang's server as a child process group from the runtime's model
flags, wait until it serves, and stop it (the whole group) within seconds.

The server runs `radix_ext`'s `session` radix-cache backend; on `--device cpu`
our out-of-tree CPU platform is switched on for it (SESSION_RUNTIME_SGLANG_CPU).
Its output goes to a log file whose tail names the cause of a failed start.

A server is alive while every process it runs serves: its own, and the
scheduler and detokenizer processes it spawned (SGLang titles them
`sglang::...`), recorded once it is ready. When one of those dies the server
process lives on but answers nothing (its HTTP side waits on the dead
scheduler), so a dead member counts as a dead server: the backend stops what
is left and starts it again.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from radix_ext.sglang.platform import ENV as CPU_PLATFORM_ENV

START_TIMEOUT_S = 600.0


class LaunchFailed(RuntimeError):
    """SGLang's server did not come up; the message names why (its log's tail)."""


@dataclass(frozen=True)
class LaunchSpec:
    model_path: str
    page_size: int
    max_total_tokens: int
    dtype: str
    device: str
    context_length: int
    max_running_requests: int = 32
    seed: int = 0
    host: str = "127.0.0.1"
    port: Optional[int] = None  # None: a free one
    extra_args: tuple[str, ...] = ()
    log_path: Optional[str] = None
    # CPU threads of its torch (OMP_NUM_THREADS) unless the environment says; None:
    # torch's default, every core. Several servers on one CPU each get their share:
    # with all of them spinning on every core, 2 servers on 2 cores decoded 9x slower.
    threads: Optional[int] = None
    tp_size: int = 1  # tensor-parallel ranks (on cpu each is bound to its share of the cores)
    api_key: Optional[str] = None  # SGLang's --api-key: every request (commands too) must carry it
    # The server's tokenizer (constrained output: its grammar backend and stop strings);
    # None: --skip-tokenizer-init, and the runtime refuses constraints on it.
    tokenizer_path: Optional[str] = None

    def argv(self, port: int) -> list[str]:
        return [
            sys.executable, "-m", "sglang.launch_server",
            "--model-path", self.model_path,
            *(["--tokenizer-path", self.tokenizer_path, "--grammar-backend", "xgrammar"] if self.tokenizer_path
              else ["--skip-tokenizer-init"]),
            "--host", self.host, "--port", str(port),
            "--device", self.device, "--dtype", self.dtype,
            "--page-size", str(self.page_size), "--max-total-tokens", str(self.max_total_tokens),
            "--context-length", str(self.context_length),
            "--max-running-requests", str(self.max_running_requests),
            "--radix-cache-backend", "session",
            # Canonical-branch prefills rank below user steps.
            "--enable-priority-scheduling",
            # An idle scheduler otherwise spins a core.
            "--sleep-on-idle",
            "--random-seed", str(self.seed),
            *(["--tp-size", str(self.tp_size)] if self.tp_size > 1 else []),
            *(["--api-key", self.api_key] if self.api_key else []),
            *self.extra_args,
        ]


def relaunch(old: "LaunchedServer", on_spawn=None, timeout_s: float = START_TIMEOUT_S) -> "LaunchedServer":
    """Start a stopped server again on the same port (so its URL and its
    control channel's address stay the same). Raises LaunchFailed."""
    from dataclasses import replace
    from urllib.parse import urlparse

    return launch(replace(old.spec, port=urlparse(old.url).port, log_path=old.log_path), old.ready, timeout_s,
                  on_spawn=on_spawn)


@dataclass
class LaunchedServer:
    """A running SGLang server this process started."""

    spec: LaunchSpec
    url: str
    process: subprocess.Popen
    log_path: str
    ready: object = None  # the readiness check it was started with
    started_s: float = 0.0
    members: dict = field(default_factory=dict)  # pid -> start time of each `sglang::` process it spawned
    _stopped: bool = field(default=False, repr=False)

    def alive(self) -> bool:
        """Its process runs, and so does every member recorded at its start
        (a few reads of /proc)."""
        return self.process.poll() is None and all(_running(pid, start) for pid, start in self.members.items())

    def dead_members(self) -> list[int]:
        return [pid for pid, start in self.members.items() if not _running(pid, start)]

    def record_members(self) -> None:
        """Remember the `sglang::` processes of its group (scheduler,
        detokenizer, one scheduler per rank), once it serves."""
        self.members = {pid: start for pid, start, title in _group(self.process.pid) if title.startswith(b"sglang::")}

    def wrote_since(self, offset: int, text: str) -> bool:
        """Whether the log holds `text` past byte `offset`."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(offset)
                return text.encode() in f.read()
        except OSError:
            return False

    def log_tail(self, lines: int = 25) -> str:
        try:
            text = Path(self.log_path).read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def stop(self, grace_s: float = 5.0) -> None:
        """SIGTERM the server's process group, SIGKILL what is left after grace_s."""
        if self._stopped:
            return
        self._stopped = True
        for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(self.process.pid, sig)
            except (ProcessLookupError, PermissionError):
                break
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline and _group_alive(self.process.pid):
                self.process.poll()
                time.sleep(0.05)
            if not _group_alive(self.process.pid):
                break
        self.process.poll()


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie leader keeps the group "alive" until reaped.
    return not _only_zombies(pgid)


def _stat(pid: int) -> Optional[list[str]]:
    """The fields of /proc/PID/stat after the command (state first), or None."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _running(pid: int, start: str) -> bool:
    """The process `pid` that started at `start` (not a reused pid) exists and is no zombie."""
    fields = _stat(pid)
    return fields is not None and fields[19] == start and fields[0] not in ("Z", "X")


def _group(pgid: int) -> list[tuple[int, str, bytes]]:
    """(pid, start time, command line) of each live process of the group."""
    out = []
    for name in os.listdir("/proc"):
        fields = _stat(int(name)) if name.isdigit() else None
        if fields is None or int(fields[2]) != pgid or fields[0] in ("Z", "X"):
            continue
        try:
            out.append((int(name), fields[19], Path(f"/proc/{name}/cmdline").read_bytes()))
        except OSError:
            continue
    return out


def _only_zombies(pgid: int) -> bool:
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[2]) == pgid and fields[0] != "Z":
            return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    """A port free now."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def launch_env(spec: LaunchSpec, base: dict) -> dict:
    """The server process's environment: ours, plus the CPU platform switch and
    its thread count where the spec asks and the environment does not."""
    env = dict(base)
    if spec.device == "cpu":
        env[CPU_PLATFORM_ENV] = "1"
        if spec.threads and "OMP_NUM_THREADS" not in env:
            env["OMP_NUM_THREADS"] = str(spec.threads)
        tp = getattr(spec, "tp_size", 1)
        if tp > 1 and "SGLANG_CPU_OMP_THREADS_BIND" not in env:
            env["SGLANG_CPU_OMP_THREADS_BIND"] = cpu_binding(tp, os.cpu_count() or 1)
    return env


def cpu_binding(ranks: int, cores: int) -> str:
    """SGLANG_CPU_OMP_THREADS_BIND for `ranks` CPU ranks: each its own run of
    cores ("0|1" for 2 ranks on 2 cores; "0-3|4-7" on 8). SGLang's CPU path
    refuses more ranks than NUMA nodes without it."""
    share = max(1, cores // ranks)
    runs = [(i * share, i * share + share - 1) for i in range(ranks)]
    return "|".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


# uvicorn's line when the HTTP port it was given is taken: the server does not exit then, it hangs in shutdown.
BIND_FAILED = "error while attempting to bind on address"
PORT_ATTEMPTS = 3


class PortTaken(LaunchFailed):
    """The server could not bind the port it was given."""


def launch(spec: LaunchSpec, ready, timeout_s: float = START_TIMEOUT_S, on_spawn=None,
           env: Optional[dict] = None) -> LaunchedServer:
    """Start the server and wait until `ready(url)` returns True. `on_spawn` is
    called with the server as soon as its process exists, so that whoever may
    stop it meanwhile (a runtime shutting down) can; a server stopped during
    start-up ends the wait. `spec` is a LaunchSpec, or anything with its `host`,
    `port`, `log_path` and `argv(port)` when `env` is given (the router's).
    A port this function chose (none in the spec) can be taken by another
    process between its choice and the server's bind (SGLang's own servers pick
    theirs the same way): the server is started again on another, at most
    PORT_ATTEMPTS times. Raises LaunchFailed with the log's tail when the
    process exits, is stopped, cannot bind, or times out."""
    for _ in range(0 if spec.port else PORT_ATTEMPTS - 1):  # a port of ours taken: another
        try:
            return _launch_once(spec, free_port(spec.host), ready, timeout_s, on_spawn, env)
        except PortTaken:
            pass
    return _launch_once(spec, spec.port or free_port(spec.host), ready, timeout_s, on_spawn, env)


def _launch_once(spec, port: int, ready, timeout_s: float, on_spawn, env: Optional[dict]) -> LaunchedServer:
    url = f"http://{spec.host}:{port}"
    log_path = spec.log_path or tempfile.mkstemp(prefix="sglang-", suffix=".log")[1]
    env = launch_env(spec, os.environ) if env is None else env
    what = getattr(spec, "name", "SGLang's server")
    t0 = time.monotonic()
    Path(log_path).parent.mkdir(parents=True, exist_ok=True)  # a data folder the runtime has not made yet
    with open(log_path, "ab") as log:
        start = log.tell()  # a relaunch appends to the old log: only what this start wrote counts
        proc = subprocess.Popen(spec.argv(port), stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)  # its own process group: stop() kills all of it
    server = LaunchedServer(spec, url, proc, log_path, ready)
    if on_spawn is not None:
        on_spawn(server)
    deadline = t0 + timeout_s
    while time.monotonic() < deadline:
        if server._stopped:
            raise LaunchFailed(f"{what} was stopped during start-up (log {log_path})")
        if not server.alive():
            tail = server.log_tail()
            server.stop()
            raise LaunchFailed(f"{what} exited with code {proc.returncode} during start-up "
                               f"(log {log_path}):\n{tail}")
        if ready(url):
            server.started_s = time.monotonic() - t0
            server.record_members()
            return server
        if server.wrote_since(start, BIND_FAILED):
            tail = server.log_tail()
            server.stop()
            raise PortTaken(f"{what} could not bind port {port}: another process holds it (log {log_path}):\n{tail}")
        time.sleep(0.5)
    tail = server.log_tail()
    server.stop()
    raise LaunchFailed(f"{what} was not ready within {timeout_s:.0f} s (log {log_path}):\n{tail}")
