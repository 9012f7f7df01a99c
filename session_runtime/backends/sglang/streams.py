"""The step streams open on one SGLang server (backend.py's part): each step's
`/generate` stream, read chunk by chunk, and `abandon`, which hangs up every
stream open on a server that stopped answering and fails the commands waiting
on it (`gone`), so nothing waits out a read timeout."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from typing import Callable, Optional

import orjson

from session_runtime.backends.base import Cancellation
from session_runtime.backends.sglang.generate import sse_chunks
from session_runtime.backends.sglang.keeper import ServerKeeper
from session_runtime.direct_http import DirectPool, TransportError
from session_runtime.errors import BackendUnavailable

_JSON = {"content-type": "application/json"}
_NON_STR_KEYS = orjson.OPT_NON_STR_KEYS  # keys written as json.dumps writes them


class StepStreams:
    """`step_http`: the server's lean step connections; `keeper`: what its
    errors mean (keeper.py). `last_answer`: when the server last sent anything."""

    def __init__(self, step_http: DirectPool, keeper: ServerKeeper):
        self.step_http = step_http
        self.keeper = keeper
        self.last_answer = time.monotonic()
        self._open: dict[object, list] = {}  # open step streams -> [abandoned, its hang-up]
        self._lock = threading.Lock()
        self._gone: Future = Future()  # resolved by abandon(): the commands waiting then fail

    def gone(self) -> Future:
        """Resolved when the server is next abandoned."""
        with self._lock:
            return self._gone

    def post(self, body: dict, cancel: Optional[Cancellation] = None):
        """Yield each streamed JSON chunk. Raises BackendUnavailable when the
        server cannot be reached or is abandoned as hung (`abandon`),
        InvalidRequest when it refuses the request. A step that is cancelled,
        or whose deadline passes, while no chunk comes (queued in the
        scheduler) closes the stream at once: SGLang aborts the request, and
        the step fails with the cancellation's error."""
        stop = None
        token = object()  # this stream, in the open ones from before its request is sent: abandon() may hang it up

        def opened(hang_up: Callable[[], None]) -> None:
            with self._lock:
                self._open[token] = [False, hang_up]

        try:
            # orjson: the prompt's ids are most of the body, and a long context's are
            # ~10x faster to write than with json (10 ms at 100k tokens, measured here)
            with self.step_http.post("/generate", orjson.dumps(body, option=_NON_STR_KEYS), _JSON,
                                     opened=opened) as resp:
                stop = cancel.watch(resp.hang_up) if cancel is not None else None
                if resp.status >= 400:
                    raise self._http_error(resp.status, resp.read().decode(errors="replace"))
                for chunk in sse_chunks(resp.iter_lines()):
                    self.last_answer = time.monotonic()
                    if "error" in chunk:
                        raise self.keeper.abort_error(str(chunk["error"]))
                    yield chunk
            if self._abandoned(token):
                raise TransportError("its stream was closed: the server stopped answering")
        except Exception as exc:
            if cancel is not None and cancel.error is not None:  # we closed it
                raise cancel.error from None
            if isinstance(exc, TransportError) or self._abandoned(token):
                raise BackendUnavailable(self.keeper.down(str(exc))) from None
            raise
        finally:
            if stop is not None:
                stop()
            with self._lock:
                self._open.pop(token, None)

    def _abandoned(self, token) -> bool:
        with self._lock:
            return token in self._open and self._open[token][0]

    def abandon(self) -> int:
        """The server stopped answering (hung, or its processes died): close
        every step stream open on it, and stop waiting for the commands sent
        to it, so those steps and commands fail at once with the retryable
        BackendUnavailable rather than wait for their read timeouts (a step so
        failed changes nothing). Returns how many steps were open."""
        with self._lock:
            open_now = list(self._open.values())
            for entry in open_now:
                entry[0] = True
            gone, self._gone = self._gone, Future()
        for _, hang_up in open_now:
            hang_up()
        gone.set_result(None)
        return len(open_now)
