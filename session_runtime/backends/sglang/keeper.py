"""A launched SGLang server kept running (backend.py's part): its watcher
checks every second and starts the server again once it, or one of its
scheduler or detokenizer processes, has died after serving; what it held is
abandoned first (`abandon`: a step in flight fails at once, retryably). Its
tree starts empty: the conversations' next steps rebuild their KV by prefill.
A server given by URL (`server` None) is only described here."""

from __future__ import annotations

import json
import logging
import threading
from typing import Callable, Optional

from session_runtime.errors import BackendUnavailable, InvalidRequest, PoolExhausted

logger = logging.getLogger(__name__)


class ServerKeeper:
    """`server`: the LaunchedServer (launcher.py), or None; `abandon()`: hang up
    everything open on it; `stop`: set when the backend closes."""

    def __init__(self, server, url: str, abandon: Callable[[], int], stop: threading.Event):
        self.server = server
        self.url = url
        self._abandon = abandon
        self._stop = stop
        self.restarts = 0
        self._closing = False
        self._lock = threading.Lock()
        self._restarting: Optional[threading.Thread] = None
        if server is not None:
            threading.Thread(target=self._watch, name="sglang-watch", daemon=True).start()

    def available(self) -> bool:
        return self.server is None or (self.server.alive() and self._restarting is None)

    def check(self) -> None:
        """Raise BackendUnavailable while a launched server is down, and start it
        again (once, in the background) when it or one of its processes has
        exited. Its tree starts empty: the conversations' next steps rebuild
        their KV by prefill."""
        if self.server is None or self.server.alive() and self._restarting is None:
            return
        if self.revive():
            raise BackendUnavailable(f"SGLang server at {self.url} is restarting after it exited; nothing "
                                     "changed, retry in a minute")

    def revive(self) -> bool:
        """Start a launched server again (in the background) when it, or one of
        its scheduler or detokenizer processes, has exited; what is left of it
        is stopped first. Returns whether it is restarting."""
        if self.server is None:
            return False
        with self._lock:
            if self._restarting is None and not self.server.alive() and not self._closing:
                code, dead = self.server.process.poll(), self.server.dead_members()
                logger.error("SGLang's server at %s %s; starting it again", self.url,
                             f"exited with code {code}" if code is not None else
                             f"lost its process{'es' if len(dead) > 1 else ''} {dead}")
                self._abandon()
                self._restarting = threading.Thread(target=self._restart, name="sglang-restart", daemon=True)
                self._restarting.start()
            return self._restarting is not None

    def _watch(self) -> None:
        """Start a launched server again once it, or one of its processes, died
        after it had served (what it held is abandoned: a step in flight fails
        at once, retryably). One that failed to start again is left to the next
        step, as before, rather than started in a loop."""
        while not self._stop.wait(1.0):
            server = self.server
            if server.members and not server.alive():
                self.revive()

    def _restart(self) -> None:
        from session_runtime.backends.sglang.launcher import LaunchFailed, relaunch

        try:
            self.server.stop()  # what is left of its process group
            relaunch(self.server, on_spawn=self._adopt)
            self.restarts += 1
            logger.warning("SGLang's server is back at %s after %.0f s", self.url, self.server.started_s)
        except LaunchFailed as exc:
            logger.error("SGLang's server did not come back: %s", exc)
        finally:
            with self._lock:
                self._restarting = None

    def _adopt(self, server) -> None:
        """The restarted server's process exists: from now on close() stops it."""
        with self._lock:
            self.server = server
            if self._closing:  # the runtime stopped while this one started
                server.stop()

    def down(self, why: str) -> str:
        state = ""
        if self.server is not None and not self.server.alive():
            code = self.server.process.poll()
            state = (f" (the SGLang process exited with code {code})" if code is not None
                     else f" (its processes {self.server.dead_members()} exited)")
        return f"SGLang server at {self.url} is unavailable{state}: {why}; nothing changed, retry once it is back"

    def http_error(self, status: int, text: str):
        """What an HTTP error of a step's request means: down (5xx) or a refusal."""
        try:
            message = json.loads(text).get("error", {}).get("message") or text
        except (ValueError, AttributeError):
            message = text
        if status >= 500:
            return BackendUnavailable(self.down(f"HTTP {status}: {message}"))
        return InvalidRequest(f"SGLang refused the step: {message}")

    def abort_error(self, message: Optional[str]):
        """What SGLang's abort of a step means: down, the pool full, or a refusal."""
        message = message or "aborted"
        if self.server is not None and not self.server.alive():
            return BackendUnavailable(self.down(message))
        lowered = message.lower()
        if "kv" in lowered and ("memory" in lowered or "pool" in lowered or "cache" in lowered):
            return PoolExhausted(f"SGLang aborted the step: {message}")
        return InvalidRequest(f"SGLang aborted the step: {message}")

    def close(self) -> None:
        """Stop the launched server, and a restart under way."""
        if self.server is None:
            return
        with self._lock:
            self._closing = True
            server, restarting = self.server, self._restarting
        server.stop()  # a restart under way stops at once: its wait sees it
        if restarting is not None:
            restarting.join(timeout=10)
        self.server.stop()
