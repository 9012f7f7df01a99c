"""Commands to the `session` tree through SGLang's own request path.

A command is a `/generate` request of one token with no output whose
`kv_hints` carry the command (`radix_ext.sglang.hints.command_envelope`); the
tree answers it at intake on every rank, and the answer comes back in the
request's `meta_info` (`radix_ext.sglang.report`). So a command is ordered
with the requests, reaches every tensor-parallel rank, and is authorized by
SGLang's `--api-key` like any request (the runtime sends the key it was given:
`--sglang-api-key`, or SGLANG_API_KEY). Nothing of ours listens on a port.
"""

from __future__ import annotations

import uuid
from typing import Any, Optional

import httpx

from radix_ext.sglang.control import ChannelDown, ControlError, result_of
from radix_ext.sglang.hints import command_envelope
from radix_ext.sglang.report import report_of

COMMAND_NAMESPACE = "session_runtime.command"  # extra_key of command requests: they share no cache with steps


class Unauthorized(ControlError):
    def __init__(self, message: str):
        super().__init__("Unauthorized", message)


def client(api_key: Optional[str] = None, timeout_s: float = 600.0, headers=None) -> httpx.Client:
    """The HTTP client for one SGLang server: its steps and its commands."""
    headers = dict(headers or {})
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    return httpx.Client(timeout=httpx.Timeout(timeout_s, connect=10.0), headers=headers,
                        limits=httpx.Limits(max_connections=256, max_keepalive_connections=64))


class RequestControl:
    """Calls the tree from any thread. Raises ControlError: ChannelDown when the
    server does not answer within `timeout_s`, Unauthorized when it refuses the key."""

    def __init__(self, url: str, http: httpx.Client, timeout_s: float = 30.0):
        self.url = url.rstrip("/")
        self.address = f"{self.url}/generate"
        self.http = http
        self.timeout_s = timeout_s
        self.calls = 0  # commands sent (the bench counts them per step)

    def call(self, name: str, timeout_s: Optional[float] = None, **args: Any) -> Any:
        body = {"input_ids": [0], "sampling_params": {"max_new_tokens": 0}, "stream": False,
                "extra_key": COMMAND_NAMESPACE, "kv_hints": command_envelope(uuid.uuid4().hex, name, args)}
        timeout = self.timeout_s if timeout_s is None else timeout_s
        self.calls += 1
        try:
            resp = self.http.post(self.address, json=body, timeout=httpx.Timeout(timeout, connect=min(timeout, 10.0)))
        except httpx.TimeoutException:
            raise ChannelDown(f"no answer from SGLang at {self.url} within {timeout:.0f} s") from None
        except httpx.TransportError as exc:
            raise ChannelDown(f"SGLang at {self.url} cannot be reached: {type(exc).__name__}: {exc}") from None
        if resp.status_code in (401, 403):
            raise Unauthorized(f"SGLang at {self.url} refused the runtime's API key (HTTP {resp.status_code}): "
                               "give the server's --api-key as --sglang-api-key or SGLANG_API_KEY")
        if resp.status_code >= 500:
            raise ChannelDown(f"SGLang at {self.url} answered HTTP {resp.status_code}: {resp.text[:200]}")
        if resp.status_code >= 400:
            raise ControlError("Refused", f"SGLang at {self.url} refused the command (HTTP {resp.status_code}): "
                                          f"{resp.text[:300]}")
        try:
            meta = resp.json().get("meta_info") or {}
        except (ValueError, AttributeError):
            raise ControlError("ProtocolError", f"SGLang at {self.url} answered {resp.text[:200]!r}") from None
        reply = report_of(meta)
        if reply is None:
            raise ControlError("ProtocolError", f"SGLang at {self.url} answered a command without the tree's "
                                                "answer: does it run --radix-cache-backend session with "
                                                "session-runtime installed beside it?")
        return result_of(reply)
