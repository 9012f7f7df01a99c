"""Error bodies of the HTTP edge, built in one place: `{error: {type, message}}`."""

from __future__ import annotations

from typing import Mapping, Optional

from fastapi.responses import JSONResponse


def error_response(status: int, kind: str, message: str, headers: Optional[Mapping[str, str]] = None) -> JSONResponse:
    # A client error will fail the same way again: tell OpenAI's SDK not to retry it.
    extra = {"x-should-retry": "false"} if 400 <= status < 500 else {}
    return JSONResponse(status_code=status, content={"error": {"type": kind, "message": message}},
                        headers={**extra, **(headers or {})})
