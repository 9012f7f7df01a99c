"""What the tree hands back for a request, in the request's own answer.

SGLang 0.5.23 carries a request's `customized_info` (a dict of lists, set on
the scheduler's `Req`) into its `meta_info`. A key is either per output token
(sliced with each streamed chunk) or request-level (sent once: with the first
chunk of a streamed request, at the end of another), as the output streamer's
`is_request_level_customized_info_key` says; the plugin makes REPORT_KEY
request-level. The tree sets the report when the request is released, just
before its last chunk is streamed: a request without output (a prefill-only
forced step, a command) under REPORT_KEY; a sampled one under
REPORT_TOKENS_KEY, one copy per output token, so that whatever slice the
last chunk carries ends with it. `report_of(meta_info)` reads it back.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Optional

from radix_ext.sglang.hints import REPORT_KEY, REPORT_TOKENS_KEY

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
    """Hand `report` back in the request's meta_info."""
    info = dict(getattr(req, "customized_info", None) or {})
    outputs = len(getattr(req, "output_ids", ()) or ())
    finished_len = getattr(req, "finished_len", None)
    if finished_len is not None:
        outputs = min(outputs, finished_len)  # a prefill-only request samples one token it never reports
    if outputs and not getattr(req, "is_prefill_only", False):
        info[REPORT_TOKENS_KEY] = [report] * outputs
    else:
        info[REPORT_KEY] = [report]
    req.customized_info = info


def report_of(meta_info: dict) -> Any:
    """The tree's report in a request's final meta_info; None when it has none."""
    for key in (REPORT_KEY, REPORT_TOKENS_KEY):
        values = [v for v in meta_info.get(key) or () if v is not None]
        if values:
            return values[-1]
    return None


def is_request_level(original, streamer, key: str) -> bool:
    """AROUND hook of SchedulerOutputStreamer.is_request_level_customized_info_key."""
    return key == REPORT_KEY or original(streamer, key)
