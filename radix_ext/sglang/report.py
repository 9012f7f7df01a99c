"""What the tree hands back for a request, in the request's own answer.

SGLang 0.5.23 carries a request's `customized_info` (a dict of lists, set on
the scheduler's `Req`) into its `meta_info`. A key is per output token by
default (sliced with each streamed chunk: a prefill-only request, which
reports no token, would send nothing, and the last chunk of a stream may
carry no new token) or request-level (sent once: with the first chunk of a
streamed request, at the end of another), as the output streamer's
`is_request_level_customized_info_key` says; the plugin makes REPORT_KEY
request-level. So the tree attaches what intake found when the request is
first matched (before its first chunk), and adds what the chain holds after
the request when it is released: a request without output (a prefill-only
forced step, a command) or a non-streamed one sends that final report; a
streamed sampled step has sent the intake part with its first chunk, and the
runtime predicts the rest (the chain then holds the step's whole computed
sequence). The tokenizer manager repeats a reported key in every later
chunk's meta_info, so the runtime reads it from the last one
(`report_of`).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Optional

from radix_ext.sglang.hints import REPORT_KEY

MAX_PENDING = 4096


class Reports:
    """Answers found at intake, waiting for their requests' release (rid ->
    report). Bounded: a request aborted while queued is never released."""

    def __init__(self, limit: int = MAX_PENDING):
        self.limit = limit
        self._by_rid: OrderedDict[str, Any] = OrderedDict()

    def put(self, rid: str, report: Any) -> None:
        self._by_rid[rid] = report
        while len(self._by_rid) > self.limit:
            self._by_rid.popitem(last=False)

    def pop(self, rid: Optional[str]) -> Any:
        return self._by_rid.pop(rid, None) if rid is not None else None

    def clear(self) -> None:
        self._by_rid.clear()

    def __len__(self) -> int:
        return len(self._by_rid)


def attach(req: Any, report: Any) -> None:
    """Hand `report` back in the request's meta_info (replacing an earlier one
    that has not been sent yet)."""
    info = dict(getattr(req, "customized_info", None) or {})
    info[REPORT_KEY] = [report]
    req.customized_info = info


def report_of(meta_info: dict) -> Any:
    """The tree's report in a request's final meta_info; None when it has none."""
    values = [v for v in meta_info.get(REPORT_KEY) or () if v is not None]
    return values[-1] if values else None


def is_request_level(original, streamer, key: str) -> bool:
    """AROUND hook of SchedulerOutputStreamer.is_request_level_customized_info_key."""
    return key == REPORT_KEY or original(streamer, key)
