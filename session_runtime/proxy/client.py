"""HTTP to a provider's API: one POST per request, the protocol's path and
authentication headers, errors as typed exceptions.

The base URL is what the provider's official SDK takes as `base_url`:
OpenAI-style APIs up to and including `/v1` (`https://api.deepseek.com/v1`,
`http://127.0.0.1:8000/v1`), Anthropic's and Google's without it
(`https://api.anthropic.com`, `https://generativelanguage.googleapis.com`).
Gemini's path names the model (`/v1beta/models/{model}:generateContent`): it is
taken out of the body into the path.
"""

from __future__ import annotations

import gzip
import json
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Optional
from urllib.parse import quote

from session_runtime.direct_http import DirectPool, TransportError, TransportTimeout
from session_runtime.errors import UpstreamUnavailable

# protocol -> (path under the base URL, environment variable of its usual key)
ENDPOINTS = {
    "deepseek": ("/chat/completions", "DEEPSEEK_API_KEY"),
    "openai-chat": ("/chat/completions", "OPENAI_API_KEY"),
    "openai-responses": ("/responses", "OPENAI_API_KEY"),
    "anthropic": ("/v1/messages", "ANTHROPIC_API_KEY"),
    "gemini": ("/v1beta/models/{model}:generateContent", "GEMINI_API_KEY"),
}
KEY_ENV = "SESSION_RUNTIME_UPSTREAM_KEY"  # wins over the protocol's usual variable
ANTHROPIC_VERSION = "2023-06-01"


def upstream_key(protocol: str, given: Optional[str] = None) -> Optional[str]:
    """`--upstream-key`, else $SESSION_RUNTIME_UPSTREAM_KEY, else the protocol's usual variable."""
    return given or os.environ.get(KEY_ENV) or os.environ.get(ENDPOINTS[protocol][1]) or None


@dataclass(frozen=True)
class UpstreamResponse:
    status: int
    body: object  # the JSON body, or the text when it is not JSON
    elapsed_ms: float
    request_id: Optional[str] = None  # the provider's, from its response headers

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300


class UpstreamClient:
    """Thread-safe. `post` (a step's request) goes over kept-alive standard-library
    connections (`direct_http.py`: a fraction of httpx's CPU per request, which
    every step of the process pays under one GIL); `stream` (the relay) over
    httpx, which decodes what a provider compresses. `post` raises
    UpstreamUnavailable when the provider cannot be reached or answers 5xx; a
    4xx comes back as a response for the caller to name."""

    def __init__(self, base_url: str, protocol: str, key: Optional[str] = None, timeout_s: float = 600.0):
        import httpx

        if protocol not in ENDPOINTS:
            raise ValueError(f"unknown upstream protocol {protocol!r}; one of {', '.join(ENDPOINTS)}")
        self.base_url = base_url.rstrip("/")
        self.protocol = protocol
        self.url = self.base_url + ENDPOINTS[protocol][0]
        self._key = upstream_key(protocol, key)
        self._http = httpx.Client(timeout=httpx.Timeout(timeout_s, connect=min(10.0, timeout_s)))
        self._direct = DirectPool(self.base_url, timeout_s=timeout_s, connect_s=min(10.0, timeout_s))
        self._path = self.url[len(self.base_url):]

    def headers(self) -> dict:
        out = {"content-type": "application/json"}
        if self.protocol == "anthropic":
            out["anthropic-version"] = ANTHROPIC_VERSION
            if self._key:
                out["x-api-key"] = self._key
        elif self.protocol == "gemini":
            if self._key:
                out["x-goog-api-key"] = self._key
        elif self._key:
            out["authorization"] = f"Bearer {self._key}"
        return out

    def post(self, body: dict, encoded: Optional[bytes] = None) -> UpstreamResponse:
        """`encoded`: the body's JSON, when the caller has it (proxy/outbound.py `encode_with`)."""
        t0 = time.perf_counter()
        path = self._path
        if self.protocol == "gemini":  # the model is in the path, not the body
            model = str(body.get("model") or "").removeprefix("models/")
            body, encoded = {k: v for k, v in body.items() if k != "model"}, None
            path = path.format(model=quote(model, safe="/"))
        content = encoded if encoded is not None else json.dumps(body, ensure_ascii=False).encode()
        try:
            with self._direct.post(path, content, self.headers()) as r:
                raw, encoding = r.read(), (r.header("content-encoding") or "").lower()
                request_id = r.header("x-request-id") or r.header("request-id")
                status = r.status
        except TransportTimeout as exc:
            raise UpstreamUnavailable(f"the upstream {self.url} did not answer in time: {exc}", status=504) from None
        except TransportError as exc:
            raise UpstreamUnavailable(f"the upstream {self.url} cannot be reached: {exc}") from None
        if encoding == "gzip":  # asked for none (identity), but a server may send it anyway
            try:
                raw = gzip.decompress(raw)
            except (OSError, EOFError) as exc:
                raise UpstreamUnavailable(f"the upstream {self.url} sent a broken gzip body: {exc}") from None
        response = UpstreamResponse(status, _body(raw), (time.perf_counter() - t0) * 1e3, request_id)
        if status >= 500:
            raise UpstreamUnavailable(f"the upstream {self.url} failed with {status}",
                                      details={"status": status, "body": response.body})
        return response

    @contextmanager
    def stream(self, body: dict) -> Iterator[tuple[int, Iterator[bytes]]]:
        """(status, the body's bytes as they arrive) of a streamed request, decoded
        (a gzipped answer comes out plain: the relay sends no Content-Encoding)."""
        import httpx

        try:
            with self._http.stream("POST", self.url, content=json.dumps(body, ensure_ascii=False).encode(),
                                   headers=self.headers()) as r:
                yield r.status_code, r.iter_bytes()
        except httpx.TimeoutException as exc:
            raise UpstreamUnavailable(f"the upstream {self.url} did not answer in time: {exc}", status=504) from None
        except httpx.HTTPError as exc:
            raise UpstreamUnavailable(f"the upstream {self.url} cannot be reached: {exc}") from None

    def close(self) -> None:
        self._http.close()
        self._direct.close()


def _body(raw: bytes) -> object:
    try:
        return json.loads(raw)
    except ValueError:
        return raw.decode(errors="replace")
