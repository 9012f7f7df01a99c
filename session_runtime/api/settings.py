"""Settings of the HTTP edge: who may call (API keys and the tenant each one
stands for) and the limits on a request. Frozen, built once (by the CLI from
its flags, before torch or SGLang is imported) and passed to create_app.

Standard library only, so a bad flag fails fast.
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Optional

MAX_TENANT_CHARS = 128


@dataclass(frozen=True)
class Caller:
    """Who a request comes from: a tenant (None: the default tenant) and
    whether it holds the admin key, which sees and may act for every tenant."""

    tenant: Optional[str]
    admin: bool

    def may_see(self, tenant: Optional[str]) -> bool:
        return self.admin or tenant == self.tenant


# Without any key configured every caller is this one, as before keys existed.
OPEN = Caller(tenant=None, admin=True)


def _digest(key: str) -> str:
    # Keys are looked up by digest, so the lookup's timing says nothing about a key.
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class Credentials:
    """The configured keys, each mapped to its Caller. Empty: authentication off."""

    callers: Mapping[str, Caller] = field(default_factory=dict)  # sha256 hex of a key -> its caller

    @property
    def enabled(self) -> bool:
        return bool(self.callers)

    @property
    def has_admin(self) -> bool:
        return any(c.admin for c in self.callers.values())

    def identify(self, key: str) -> Optional[Caller]:
        """The caller a presented key stands for; None for an unknown key."""
        return self.callers.get(_digest(key))


def load_credentials(api_key: Optional[str] = None, api_keys_file: Optional[str] = None,
                     admin_key: Optional[str] = None) -> Credentials:
    """Credentials from the CLI's flags. `api_key` is the default tenant's key,
    and the admin key too unless `admin_key` is given; `api_keys_file` is a JSON
    object mapping each key to its tenant's name. Raises ValueError with a
    message for the operator."""
    callers: dict[str, Caller] = {}

    def add(flag: str, key: object, caller: Caller) -> None:
        if not isinstance(key, str) or not key.strip() or key != key.strip() or not (key.isascii() and key.isprintable()):
            raise ValueError(f"{flag}: a key must be a non-empty string of printable ASCII characters "
                             "(it travels in an HTTP header), without surrounding spaces")
        if _digest(key) in callers:
            raise ValueError(f"{flag}: a key is given twice (each key stands for one tenant)")
        callers[_digest(key)] = caller

    if admin_key is not None:
        add("--admin-key", admin_key, Caller(tenant=None, admin=True))
    if api_key is not None:
        add("--api-key", api_key, Caller(tenant=None, admin=admin_key is None))
    if api_keys_file is not None:
        for key, tenant in _read_keys_file(api_keys_file).items():
            add(f"--api-keys {api_keys_file}", key, Caller(tenant=tenant, admin=False))
    return Credentials(callers)


def _read_keys_file(path: str) -> dict[str, str]:
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise ValueError(f"--api-keys {path}: cannot read it ({exc.strerror})") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"--api-keys {path}: not JSON ({exc})") from None
    if not isinstance(data, dict) or not data:
        raise ValueError(f'--api-keys {path}: must be a non-empty JSON object {{"KEY": "TENANT", ...}}')
    for tenant in data.values():
        if not isinstance(tenant, str) or not tenant.strip() or len(tenant) > MAX_TENANT_CHARS:
            raise ValueError(f"--api-keys {path}: each tenant must be a non-empty string of at most "
                             f"{MAX_TENANT_CHARS} characters, got {tenant!r}")
    return data


def is_loopback(host: str) -> bool:
    """Whether binding `host` serves this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # another host name: it may resolve to anything


LOOPBACK_NAMES = ("localhost", "127.0.0.1", "[::1]")


def allowed_hosts(host: str, extra: Optional[str] = None) -> Optional[frozenset[str]]:
    """The Host header values a server bound to `host` answers: `host`, the
    loopback names, and `extra` (comma-separated; `*`: any, None returned)."""
    names = [n.strip().lower() for n in (extra or "").split(",") if n.strip()]
    if "*" in names:
        return None
    bound = f"[{host.strip('[]')}]" if ":" in host else host
    return frozenset({bound.lower(), *LOOPBACK_NAMES, *names})


def host_name(header: str) -> str:
    """A Host header without its port: `[::1]:8000` -> `[::1]`."""
    header = header.strip().lower()
    if header.startswith("["):
        return header.split("]", 1)[0] + "]"
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


@dataclass(frozen=True)
class ApiSettings:
    credentials: Credentials = Credentials()
    metrics_admin_only: bool = False  # /metrics needs the admin key (else it is open)
    max_body_bytes: int = 4 * 1024 * 1024  # larger request bodies get 413 unread
    # Host header values answered (without the port); others get 400, so a
    # page on another site cannot reach the server by DNS rebinding. None: any.
    allowed_hosts: Optional[frozenset[str]] = None
    # Check incoming requests the way this provider's API does before answering
    # (deepseek, openai-chat, openai-responses, anthropic): a validating upstream for tests.
    validate: Optional[str] = None

    def __post_init__(self) -> None:
        if self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be >= 1, got {self.max_body_bytes}")
        if self.metrics_admin_only and not self.credentials.has_admin:
            raise ValueError("metrics_admin_only (--metrics-admin-only) needs an admin key (--admin-key, or a lone --api-key)")
