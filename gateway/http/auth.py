"""API keys on the HTTP endpoint: the `Authorization: Bearer KEY` header, against the same
key store as the gRPC API (gateway/auth.py), with the same checks and limits.

`require_key` is the routes' FastAPI dependency: it authenticates the caller and counts the
call against its key's rate (None when the gateway has no key file). A generation also asks
`admit_stream` for its key's priority class and one of its streams. Refusals are OpenAI-shaped
errors: 401 (with `WWW-Authenticate: Bearer`), 403, and 429 with `Retry-After` in seconds.
"""

import logging
import math
from collections.abc import Callable

from fastapi import Request
from fastapi.responses import JSONResponse

from gateway.auth import ApiKey, AuthCode, AuthError, KeyStore, bearer_token

log = logging.getLogger("gateway.auth")

_ERRORS = {  # AuthCode -> (HTTP status, OpenAI error type, code)
    AuthCode.UNAUTHENTICATED: (401, "authentication_error", "invalid_api_key"),
    AuthCode.PERMISSION_DENIED: (403, "permission_error", "permission_denied"),
    AuthCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error", "rate_limit_exceeded"),
}


def _no_release() -> None:
    pass


def key_dependency(keys: KeyStore | None) -> Callable:
    """The dependency every /v1 route takes: the caller's ApiKey (None without a key file)."""
    async def require_key(request: Request) -> ApiKey | None:
        if keys is None:
            return None
        key = keys.authenticate(bearer_token(request.headers.get("authorization")))
        keys.take_request(key)
        return key

    return require_key


def admit_stream(keys: KeyStore | None, key: ApiKey | None, priority: str) -> Callable[[], None]:
    """Checks the key's priority classes and opens one of its streams; the callable that closes
    it (idempotent). Raises AuthError."""
    if keys is None or key is None:
        return _no_release
    keys.check_priority(key, priority)
    close = keys.open_stream(key)
    is_open = True

    def release() -> None:
        nonlocal is_open
        if is_open:
            is_open = False
            close()

    return release


def auth_error_response(error: AuthError) -> JSONResponse:
    """The OpenAI-shaped response of a refused call."""
    status, kind, code = _ERRORS[error.code]
    headers = {}
    if error.code is AuthCode.UNAUTHENTICATED:
        headers["WWW-Authenticate"] = "Bearer"
    if error.retry_after_s is not None:
        headers["Retry-After"] = str(max(1, math.ceil(error.retry_after_s)))
    log.info("refused an HTTP call: %s", error.message)
    body = {"error": {"message": error.message, "type": kind, "param": None, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)
