"""Commands to the tree inside SGLang's scheduler, for what has no step of its
own (release a chain, move it back to a fork point, mark it idle or waiting,
snapshot, integrity check, pool figures).

A command rides a request of its own through SGLang's ordered request path
(`hints.command_envelope`): SGLang's `--api-key` authorizes it, and every
tensor-parallel rank receives it in the same scheduler iteration, in order
with the requests. The tree answers it at intake (`SchedulerSessionCache.intake`,
between batches, on the scheduler's thread) and the answer comes back in the
request's `meta_info`, versioned:

    {"v": 1, "ok": true, "result": ...}
  | {"v": 1, "ok": false, "error": {"type": T, "message": M}}

A malformed or stale command gets an error answer and changes nothing; no
error of a command reaches SGLang's loop. Nothing of ours listens on a socket.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

logger = logging.getLogger(__name__)

VERSION = 1


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


Handler = Callable[[dict, Any], Any]  # (args, scheduler) -> JSON-able result


def answer(handlers: dict[str, Handler], name: Any, args: Any, scheduler: Any) -> dict:
    """Run one command; its answer, never an exception."""
    try:
        if not isinstance(name, str) or not isinstance(args, dict):
            raise BadCommand(f"a command is {{cmd: string, args: object}} of version {VERSION}")
        handler = handlers.get(name)
        if handler is None:
            raise BadCommand(f"unknown command {name!r}; known: {sorted(handlers)}")
        return {"v": VERSION, "ok": True, "result": handler(args, scheduler)}
    except ControlError as exc:
        return _error(exc.kind, exc.message)
    except AssertionError as exc:  # check_integrity found something
        return _error("IntegrityError", str(exc))
    except Exception as exc:  # a bug of ours must not take the scheduler down
        logger.exception("control command %r failed", name)
        return _error(type(exc).__name__, str(exc))


def refusal(message: str) -> dict:
    """The answer of a command refused before it ran."""
    return _error("BadCommand", message)


def _error(kind: str, message: str) -> dict:
    return {"v": VERSION, "ok": False, "error": {"type": kind, "message": message}}


def result_of(reply: Any) -> Any:
    """The result of an answer; raises the ControlError it carries."""
    if not isinstance(reply, dict) or reply.get("v") != VERSION:
        raise ControlError("ProtocolError", f"not an answer of version {VERSION}: {str(reply)[:200]}")
    if reply.get("ok"):
        return reply.get("result")
    err = reply.get("error") or {}
    kind, message = err.get("type", "Error"), err.get("message", "")
    cls = {"BadCommand": BadCommand, "StaleCommand": StaleCommand}.get(kind)
    raise cls(message) if cls else ControlError(kind, message)
