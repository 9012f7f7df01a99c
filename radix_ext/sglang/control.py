"""The control channel: commands from the runtime to the tree inside SGLang's
scheduler process, for what has no request of its own (hold or release a
chain, move a chain back to a fork point, snapshot, integrity check, pool
figures).

Wire format: one JSON object per ZeroMQ message, versioned,

    request  {"v": 1, "cmd": NAME, "args": {...}}
    reply    {"v": 1, "ok": true, "result": ...}
           | {"v": 1, "ok": false, "error": {"type": T, "message": M}}

The server is a ROUTER socket owned by the scheduler thread: `serve()` runs
from a hook before the scheduler processes its inputs, that is between
batches, so a command never sees a batch half-built. A malformed or stale
command gets an error reply and changes nothing. The client opens a REQ
socket per call, so any number of threads may call at once.

Address: `SESSION_RUNTIME_CONTROL_ADDR`, else derived from SGLang's port
(`control_address(host, port)`); the runtime derives the same one.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from typing import Any, Callable, Optional

logger = logging.getLogger(__name__)

VERSION = 1
ENV_ADDR = "SESSION_RUNTIME_CONTROL_ADDR"
PORT_OFFSET = 2048


def control_address(host: str, port: int) -> str:
    """The channel's address for an SGLang server on host:port."""
    if os.environ.get(ENV_ADDR):
        return os.environ[ENV_ADDR]
    cport = port + PORT_OFFSET if port + PORT_OFFSET <= 65535 else port - PORT_OFFSET
    return f"tcp://{host}:{cport}"


class ControlError(Exception):
    """A command the tree refused; `kind` is the error type on the wire."""

    def __init__(self, kind: str, message: str):
        super().__init__(f"{kind}: {message}")
        self.kind = kind
        self.message = message


class BadCommand(ControlError):
    def __init__(self, message: str):
        super().__init__("BadCommand", message)


class StaleCommand(ControlError):
    def __init__(self, message: str):
        super().__init__("StaleCommand", message)


class ChannelDown(ControlError):
    def __init__(self, message: str):
        super().__init__("ChannelDown", message)


@dataclass(frozen=True)
class Command:
    name: str
    args: dict

    @staticmethod
    def decode(raw: bytes) -> "Command":
        """Raises BadCommand for anything but a versioned {cmd, args} object."""
        try:
            msg = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            raise BadCommand(f"not JSON: {exc}") from None
        if not isinstance(msg, dict) or msg.get("v") != VERSION:
            raise BadCommand(f"expected an object with v={VERSION}")
        name, args = msg.get("cmd"), msg.get("args", {})
        if not isinstance(name, str) or not isinstance(args, dict):
            raise BadCommand("cmd must be a string and args an object")
        return Command(name, args)

    def encode(self) -> bytes:
        return json.dumps({"v": VERSION, "cmd": self.name, "args": self.args}).encode()


def _reply(ok: bool, payload: Any) -> bytes:
    key = "result" if ok else "error"
    return json.dumps({"v": VERSION, "ok": ok, key: payload}).encode()


Handler = Callable[[dict, Any], Any]  # (args, scheduler) -> JSON-able result


class ControlServer:
    """Answers commands on the scheduler's thread. Never raises into SGLang."""

    def __init__(self, address: str, handlers: dict[str, Handler]):
        import zmq

        self.address = address
        self.handlers = handlers
        self._zmq = zmq
        self.context = zmq.Context.instance()
        self.socket = self.context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.bind(address)
        self._woken_by_idle_sleeper = False
        self.served = 0

    def serve(self, scheduler: Any) -> int:
        """Answer every command waiting now; returns how many."""
        if not self._woken_by_idle_sleeper and getattr(scheduler, "idle_sleeper", None) is not None:
            # --sleep-on-idle polls SGLang's sockets for up to 1 s: poll ours too,
            # so a command to an idle server is answered at once.
            poller = getattr(scheduler.idle_sleeper, "poller", None)
            if poller is not None:
                poller.register(self.socket, self._zmq.POLLIN)
            self._woken_by_idle_sleeper = True
        count = 0
        while True:
            try:
                frames = self.socket.recv_multipart(flags=self._zmq.NOBLOCK)
            except self._zmq.Again:
                return count
            ident, body = frames[0], frames[-1]
            self.socket.send_multipart([ident, b"", self._answer(body, scheduler)])
            count += 1
            self.served += 1

    def _answer(self, body: bytes, scheduler: Any) -> bytes:
        try:
            cmd = Command.decode(body)
            handler = self.handlers.get(cmd.name)
            if handler is None:
                raise BadCommand(f"unknown command {cmd.name!r}; known: {sorted(self.handlers)}")
            return _reply(True, handler(cmd.args, scheduler))
        except ControlError as exc:
            return _reply(False, {"type": exc.kind, "message": exc.message})
        except AssertionError as exc:  # check_integrity found something
            return _reply(False, {"type": "IntegrityError", "message": str(exc)})
        except Exception as exc:  # a bug of ours must not take the scheduler down
            logger.exception("control command failed")
            return _reply(False, {"type": type(exc).__name__, "message": str(exc)})

    def close(self) -> None:
        self.socket.close(0)


class ControlClient:
    """Calls the channel from any thread. Raises ControlError (ChannelDown when
    the scheduler does not answer within `timeout_s`)."""

    def __init__(self, address: str, timeout_s: float = 30.0):
        import zmq

        self.address = address
        self.timeout_ms = int(timeout_s * 1000)
        self._zmq = zmq
        self.context = zmq.Context.instance()

    def call(self, name: str, timeout_s: Optional[float] = None, **args: Any) -> Any:
        zmq = self._zmq
        sock = self.context.socket(zmq.REQ)
        sock.setsockopt(zmq.LINGER, 0)
        timeout = self.timeout_ms if timeout_s is None else int(timeout_s * 1000)
        sock.setsockopt(zmq.RCVTIMEO, timeout)
        sock.setsockopt(zmq.SNDTIMEO, timeout)
        try:
            sock.connect(self.address)
            sock.send(Command(name, args).encode())
            raw = sock.recv()
        except zmq.Again:
            raise ChannelDown(f"no answer from the scheduler at {self.address} within {timeout / 1000:.0f} s") from None
        finally:
            sock.close(0)
        msg = json.loads(raw)
        if msg.get("ok"):
            return msg.get("result")
        err = msg.get("error") or {}
        kind, message = err.get("type", "Error"), err.get("message", "")
        cls = {"BadCommand": BadCommand, "StaleCommand": StaleCommand}.get(kind)
        raise cls(message) if cls else ControlError(kind, message)
