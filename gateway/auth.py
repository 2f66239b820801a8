"""Client API keys of the gateway: the key file, who a bearer token is, and per-key limits.

One pure store serves both transports: the gRPC interceptor (gateway/auth_grpc.py, the
`authorization: Bearer KEY` metadata) and the HTTP endpoint's dependency (gateway/http/app.py,
the `Authorization: Bearer KEY` header). Neither ever logs, traces or labels a key: only its
`name` from the file.

The key file (`--api-keys FILE`, JSON; a Kubernetes Secret mounted as a file works as is):

    {"keys": [{"name": "team-a", "sha256": "<hex sha256 of the key>",
               "priorities": ["interactive", "batch"],
               "requests_per_s": 20, "burst": 40, "max_streams": 16}]}

`name` (unique) and `sha256` are required; `priorities` defaults to both classes; a limit of 0
(the default) is no limit; `burst` defaults to max(1, requests_per_s). Keys are stored as the
SHA-256 of the key, not a salted slow KDF: keys are random 256-bit tokens (`new_key`), which
no dictionary attack can guess, so a slow hash would only cost every request its time; an
unsalted hash also finds the key in one dict lookup. The file is checked for changes (size,
mtime, inode) at most every `reload_interval_s` when a call comes in and re-read without a
restart: a key removed from it is refused from then on. A file that does not parse keeps the
keys read before (logged).

Errors are AuthError with an AuthCode; each transport maps the code to its own status
(UNAUTHENTICATED/401, PERMISSION_DENIED/403, RESOURCE_EXHAUSTED/429 with a retry hint).
`ApiKeyCollector` exports the refusals and open streams per key name at scrape time.
"""

import collections
import contextvars
import dataclasses
import enum
import hashlib
import json
import logging
import os
import secrets
import time
from collections.abc import Callable

from services import metrics

log = logging.getLogger("gateway.auth")

PRIORITIES = ("interactive", "batch")
# The key label of refusals whose token names no key (none, or unknown).
UNKNOWN_KEY = "-"
KEY_PREFIX = "mm-"


class AuthCode(enum.Enum):
    UNAUTHENTICATED = "unauthenticated"
    PERMISSION_DENIED = "permission_denied"
    RESOURCE_EXHAUSTED = "resource_exhausted"


class AuthError(Exception):
    """A call refused; retry_after_s is set for RESOURCE_EXHAUSTED (when to try again)."""

    def __init__(self, code: AuthCode, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.retry_after_s = retry_after_s


def hash_key(key: str) -> str:
    """The hex SHA-256 of a key: what the key file stores."""
    return hashlib.sha256(key.encode()).hexdigest()


def new_key() -> str:
    """A fresh random key (256 bits)."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


def bearer_token(value: str | None) -> str | None:
    """The token of an `authorization` value "Bearer TOKEN" (case-insensitive scheme), else None."""
    if not value:
        return None
    scheme, _, token = value.strip().partition(" ")
    return token.strip() or None if scheme.lower() == "bearer" else None


# The name of the key the current call authenticated with (None: no key file, or not a call of
# the API). Set by the gRPC interceptor around the handler; a request records it as its owner,
# so that Abort ends only the caller's own requests (gateway/live_requests.py).
caller_key_name: contextvars.ContextVar[str | None] = contextvars.ContextVar("caller_key_name", default=None)


@dataclasses.dataclass(frozen=True, slots=True)
class ApiKey:
    """One entry of the key file (no secret: the key's hash only)."""

    name: str
    sha256: str
    priorities: frozenset[str] = frozenset(PRIORITIES)
    # Calls per second (a token bucket of `burst`); 0: no limit.
    requests_per_s: float = 0.0
    burst: float = 0.0
    # Generate streams open at once; 0: no limit.
    max_streams: int = 0

    def __post_init__(self) -> None:
        if not self.name or not isinstance(self.name, str):
            raise ValueError(f"a key needs a name, got {self.name!r}")
        if len(self.sha256) != 64 or any(c not in "0123456789abcdef" for c in self.sha256):
            raise ValueError(f"key {self.name!r}: sha256 must be 64 lowercase hex digits")
        unknown = set(self.priorities) - set(PRIORITIES)
        if unknown:
            raise ValueError(f"key {self.name!r}: unknown priorities {sorted(unknown)}; known: {PRIORITIES}")
        if self.requests_per_s < 0 or self.burst < 0 or self.max_streams < 0:
            raise ValueError(f"key {self.name!r}: limits must be >= 0")

    @classmethod
    def from_json(cls, entry: dict) -> "ApiKey":
        rps = float(entry.get("requests_per_s", 0))
        return cls(name=entry.get("name", ""), sha256=str(entry.get("sha256", "")).lower(),
                   priorities=frozenset(entry.get("priorities", PRIORITIES)), requests_per_s=rps,
                   burst=float(entry.get("burst", max(1.0, rps))), max_streams=int(entry.get("max_streams", 0)))


def parse_key_file(text: str) -> dict[str, ApiKey]:
    """The keys of a key file's text, by hash; ValueError naming what is wrong."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"the key file is not JSON: {error}") from None
    if not isinstance(data, dict) or not isinstance(data.get("keys"), list):
        raise ValueError('the key file must be an object {"keys": [...]}')
    keys = [ApiKey.from_json(entry) for entry in data["keys"]]
    names = [k.name for k in keys]
    if len(set(names)) != len(names):
        raise ValueError("key names must be unique")
    return {k.sha256: k for k in keys}


class _Usage:
    """One key's token bucket and open streams (kept across reloads, by name)."""

    __slots__ = ("tokens", "updated", "num_streams")

    def __init__(self, burst: float, now: float) -> None:
        self.tokens, self.updated, self.num_streams = burst, now, 0


class KeyStore:
    """The keys of one key file, reloaded on change, and their usage."""

    def __init__(self, path: str, *, reload_interval_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.path = path
        self._reload_interval_s = reload_interval_s
        self._clock = clock
        self._keys: dict[str, ApiKey] = {}
        self._usage: dict[str, _Usage] = {}
        self._stamp: tuple | None = None
        # (key name or UNKNOWN_KEY, AuthCode value) -> refusals since start.
        self.refusals: collections.Counter[tuple[str, str]] = collections.Counter()
        self._load(required=True)
        self._checked_at = clock()

    def _load(self, *, required: bool = False) -> None:
        try:
            stat = os.stat(self.path)
            stamp = (stat.st_ino, stat.st_size, stat.st_mtime_ns)
            if stamp == self._stamp:
                return
            with open(self.path, encoding="utf-8") as f:
                keys = parse_key_file(f.read())
        except (OSError, ValueError) as error:
            if required:
                raise ValueError(f"api key file {self.path}: {error}") from None
            log.warning("api key file %s not reloaded, keeping %d keys: %s", self.path, len(self._keys), error)
            return
        self._stamp, self._keys = stamp, keys
        names = {k.name for k in keys.values()}
        self._usage = {name: usage for name, usage in self._usage.items() if name in names}
        log.info("api key file %s: %d keys (%s)", self.path, len(keys), ", ".join(sorted(names)))

    def _maybe_reload(self) -> None:
        now = self._clock()
        if now - self._checked_at >= self._reload_interval_s:
            self._checked_at = now
            self._load()

    def authenticate(self, token: str | None) -> ApiKey:
        """The key of a bearer token; AuthError UNAUTHENTICATED for none or an unknown one."""
        self._maybe_reload()
        if not token:
            raise self._refused(UNKNOWN_KEY, AuthError(
                AuthCode.UNAUTHENTICATED, "an API key is required (authorization: Bearer KEY)"))
        key = self._keys.get(hash_key(token))
        if key is None:
            raise self._refused(UNKNOWN_KEY, AuthError(AuthCode.UNAUTHENTICATED, "the API key is not valid"))
        return key

    def _refused(self, name: str, error: AuthError) -> AuthError:
        self.refusals[name, error.code.value] += 1
        return error

    def open_streams(self) -> dict[str, int]:
        """Open streams per key name (keys that had any since their last reload)."""
        return {name: usage.num_streams for name, usage in self._usage.items()}

    def check_priority(self, key: ApiKey, priority: str) -> None:
        """AuthError PERMISSION_DENIED unless the key may ask for the priority class."""
        if priority not in key.priorities:
            raise self._refused(key.name, AuthError(AuthCode.PERMISSION_DENIED,
                                                    f"API key {key.name!r} may not use priority {priority!r}"))

    def take_request(self, key: ApiKey) -> None:
        """Counts one call against the key's rate; AuthError RESOURCE_EXHAUSTED (with the
        wait until a token is back) when its bucket is empty."""
        if not key.requests_per_s:
            return
        now = self._clock()
        usage = self._usage_of(key, now)
        usage.tokens = min(key.burst, usage.tokens + (now - usage.updated) * key.requests_per_s)
        usage.updated = now
        if usage.tokens < 1.0:
            wait_s = (1.0 - usage.tokens) / key.requests_per_s
            raise self._refused(key.name, AuthError(
                AuthCode.RESOURCE_EXHAUSTED, f"API key {key.name!r} is over its rate of {key.requests_per_s:g} "
                                             "requests/s", retry_after_s=wait_s))
        usage.tokens -= 1.0

    def open_stream(self, key: ApiKey) -> Callable[[], None]:
        """Counts an open stream of the key; returns the callable that closes it (call once).
        AuthError RESOURCE_EXHAUSTED when the key has max_streams open."""
        usage = self._usage_of(key, self._clock())
        if key.max_streams and usage.num_streams >= key.max_streams:
            raise self._refused(key.name, AuthError(
                AuthCode.RESOURCE_EXHAUSTED, f"API key {key.name!r} has its {key.max_streams} streams open",
                retry_after_s=1.0))
        usage.num_streams += 1

        def close() -> None:
            usage.num_streams -= 1

        return close

    def admit_generate(self, key: ApiKey, priority: str) -> Callable[[], None]:
        """A generation's checks in order (class, rate, streams); the stream's close callable."""
        self.check_priority(key, priority)
        self.take_request(key)
        return self.open_stream(key)

    def _usage_of(self, key: ApiKey, now: float) -> _Usage:
        usage = self._usage.get(key.name)
        if usage is None:
            usage = self._usage[key.name] = _Usage(key.burst, now)
        return usage


class ApiKeyCollector:
    """Scrape-time metrics of a KeyStore (None: the families without samples), by key name."""

    def __init__(self, store: KeyStore | None) -> None:
        self._store = store

    def collect(self):
        refusals = metrics.counter_family("api_key_refusals", "Calls refused by the API key check, by key name "
                                          "(- for no or an unknown key) and reason.", ["key", "reason"])
        streams = metrics.gauge_family("api_key_open_streams", "Generate streams open per key name.", ["key"])
        if self._store is not None:
            for (name, reason), count in sorted(self._store.refusals.items()):
                refusals.add_metric([name, reason], count)
            for name, count in sorted(self._store.open_streams().items()):
                streams.add_metric([name], count)
        yield refusals
        yield streams
