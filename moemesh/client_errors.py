"""The Python client's errors: every failed call raises a MoemeshError carrying its gRPC status code.

One subclass per status code that callers act on (InvalidArgumentError,
NotFoundError, UnavailableError, DeadlineExceededError,
ResourceExhaustedError, CancelledError); other codes raise MoemeshError itself.
INVALID_ARGUMENT's details start with the field they refuse
("sampling.top_k must be in ...", "messages: ..."): `field` is that name.
"""

from __future__ import annotations

import re

import grpc

# The field a gateway INVALID_ARGUMENT names: the details' first word, a dotted path with optional [i].
_FIELD = re.compile(r"([A-Za-z_][\w.\[\]]*?):?(?:\s|$)")


class MoemeshError(Exception):
    """A failed call: `code` (a grpc.StatusCode), `details` (the server's message), `field` (INVALID_ARGUMENT's)."""

    def __init__(self, code: grpc.StatusCode, details: str, *, after_first_token: bool = False) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details
        # True when the stream had delivered tokens before it failed (the call was not retried).
        self.after_first_token = after_first_token

    @property
    def field(self) -> str | None:
        """The request field an INVALID_ARGUMENT names ("sampling.top_k"), else None."""
        if self.code != grpc.StatusCode.INVALID_ARGUMENT:
            return None
        match = _FIELD.match(self.details)
        return match.group(1) if match else None


class InvalidArgumentError(MoemeshError):
    """The gateway refused the request; `field` names the bad field."""


class NotFoundError(MoemeshError):
    """Abort: no live request has the id."""


class UnavailableError(MoemeshError):
    """No gateway answered, or it has no worker group; retried before the first token, raised after it."""


class DeadlineExceededError(MoemeshError):
    """The call's timeout passed."""


class ResourceExhaustedError(MoemeshError):
    """The gateway is shedding load."""


class CancelledError(MoemeshError):
    """The call was cancelled."""


_BY_CODE: dict[grpc.StatusCode, type[MoemeshError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgumentError,
    grpc.StatusCode.NOT_FOUND: NotFoundError,
    grpc.StatusCode.UNAVAILABLE: UnavailableError,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceededError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhaustedError,
    grpc.StatusCode.CANCELLED: CancelledError,
}


def error(code: grpc.StatusCode, details: str, *, after_first_token: bool = False) -> MoemeshError:
    """The MoemeshError (subclass) of a status code."""
    return _BY_CODE.get(code, MoemeshError)(code, details, after_first_token=after_first_token)


def from_rpc_error(err: grpc.RpcError, *, after_first_token: bool = False) -> MoemeshError:
    """The MoemeshError of a failed gRPC call (a grpc.Call or grpc.aio.AioRpcError)."""
    code = err.code() if callable(getattr(err, "code", None)) else grpc.StatusCode.UNKNOWN
    details = err.details() if callable(getattr(err, "details", None)) else str(err)
    return error(code, details or "", after_first_token=after_first_token)
