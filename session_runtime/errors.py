"""Typed exceptions for misuse of the Python API; the HTTP edge maps each to a 4xx."""

from __future__ import annotations

from typing import Optional


class RuntimeErrorBase(Exception):
    """Base of every error the runtime raises on purpose. `param` names the
    request field at fault, where there is one (OpenAI's error has it)."""

    status = 400
    error_type = "invalid_request"
    param: Optional[str] = None

    def __init__(self, *args: object, param: Optional[str] = None):
        super().__init__(*args)
        if param is not None:
            self.param = param


class ConversationNotFound(RuntimeErrorBase, KeyError):
    status = 404
    error_type = "not_found"

    def __str__(self) -> str:  # KeyError quotes its argument; we want plain text
        return f"conversation {self.args[0]!r} not found"


class WorkerNotFound(RuntimeErrorBase, KeyError):
    status = 404
    error_type = "not_found"

    def __str__(self) -> str:
        return f"no SGLang worker {self.args[0]!r} (many workers: see /health)"


class InvalidRequest(RuntimeErrorBase, ValueError):
    """Bad input: an empty message, unknown options, a negative max_tokens."""

    status = 422


class ContextTooLong(InvalidRequest):
    status = 413
    error_type = "context_too_long"


class PoolExhausted(RuntimeErrorBase):
    """The KV pool cannot hold the request even after evicting every unlocked leaf."""

    status = 507
    error_type = "pool_exhausted"


class ConversationBusy(RuntimeErrorBase):
    status = 409
    error_type = "conflict"


class HistoryConflict(RuntimeErrorBase):
    """A chat client's history is not the stored conversation's (nor only new
    input): refused rather than replace what is stored."""

    status = 409
    error_type = "history_conflict"


class ToolCallConflict(RuntimeErrorBase):
    """A tool result for an unknown or already answered call, or none pending."""

    status = 409
    error_type = "conflict"


class BackendUnavailable(RuntimeErrorBase):
    """The serving backend (an SGLang server) is down or did not answer. Nothing
    changed; the request may be retried once it is back."""

    status = 503
    error_type = "backend_unavailable"


class StepCancelled(RuntimeErrorBase):
    """The step was stopped before it finished (its client went away); it changed nothing."""

    status = 499
    error_type = "cancelled"


class DeadlineExceeded(StepCancelled):
    status = 408
    error_type = "timeout"


class ShuttingDown(StepCancelled):
    status = 503
    error_type = "unavailable"


class StorageUnavailable(RuntimeErrorBase):
    """The data file could not be written: the change was not made (retry it)."""

    status = 503
    error_type = "storage_unavailable"


class StorageFull(StorageUnavailable):
    """The store has no room left (its disk, or its database's): the change
    was not made; it goes through once space is freed."""

    status = 507
    error_type = "storage_full"


def storage_failure(what: str, exc: BaseException) -> StorageUnavailable:
    """The error for `what` (the change that was not saved, and so not made)
    failing with `exc`: StorageFull when the store is out of room (SQLite's
    SQLITE_FULL, the disk's ENOSPC or EDQUOT, PostgreSQL's disk_full), else
    StorageUnavailable."""
    import errno
    import sqlite3

    seen = exc
    while seen is not None:
        full = (isinstance(seen, sqlite3.Error) and getattr(seen, "sqlite_errorcode", None) == sqlite3.SQLITE_FULL
                or isinstance(seen, OSError) and seen.errno in (errno.ENOSPC, errno.EDQUOT)
                or getattr(seen, "sqlstate", None) == "53100")
        if full:
            return StorageFull(f"{what}: the store is full ({exc}); free space and send it again")
        seen = seen.__cause__ or seen.__context__
    return StorageUnavailable(f"{what}: {exc}")


class TooManyConversations(RuntimeErrorBase):
    """The tenant already has as many conversations as the server keeps for one."""

    status = 429
    error_type = "conversation_limit"


class TenantStorageFull(RuntimeErrorBase):
    """The tenant's conversations already hold the bytes the server keeps for one."""

    status = 429
    error_type = "storage_limit"


class UpstreamError(RuntimeErrorBase):
    """Upstream proxy mode: the provider refused the request. Its status comes
    back; `details` holds the provider's error body, the name of a known
    provider error, and what the outbound stripper did to the request."""

    error_type = "upstream_error"

    def __init__(self, message: str, status: int, details: dict):
        super().__init__(message)
        self.status = status
        self.details = details


class UpstreamUnavailable(BackendUnavailable):
    """The provider did not answer (refused, reset, timed out, or a 5xx). Nothing
    changed; retry it."""

    status = 502
    error_type = "upstream_unavailable"

    def __init__(self, message: str, details: Optional[dict] = None, status: int = 502):
        super().__init__(message)
        self.status = status
        self.details = details


class OwnedElsewhere(RuntimeErrorBase):
    """A stateless request's conversation is served by another runtime process
    of the fleet: api/forward.py relays the request there (RELAY names it);
    a request relayed once already gets this 503 and may retry."""

    status = 503
    error_type = "unavailable"
    RELAY = "x-session-runtime-relay-to"

    def __init__(self, cid: str, owner: str, url: str):
        super().__init__(f"conversation {cid!r} is served by runtime process {owner}, which took it over while "
                         "this request was relayed; retry")
        self.headers = {self.RELAY: f"{owner} {url}", "retry-after": "1"}
