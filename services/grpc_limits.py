"""Hostile input at a gRPC server: requests that do not parse, handler errors, explicit limits.

grpc.aio answers a request whose bytes the method's deserializer refuses with UNKNOWN and the
details "Unexpected <class 'google.protobuf.message.DecodeError'>: ...": an internal class name
on the wire, and a server error on every dashboard for what is the client's fault.
`HostileInputInterceptor` replaces each method's request deserializer with one that turns a
DecodeError into a marker, and the method's behaviour answers the marker with INVALID_ARGUMENT
before the servicer sees it (for streamed requests, when the bad message is read). It also
stands between the servicer and gRPC's own catch-all: an exception that escapes a handler is
logged here with its stack and answered INTERNAL "internal error", never with its class or text.

`ServerLimits` are the explicit bounds of a server (message sizes, concurrent streams per
connection, metadata size, keepalive enforcement, idle connections) as grpc channel options.
Any role may use both: pass `HostileInputInterceptor()` in `interceptors` and
`ServerLimits(...).options()` in `options` of grpc_util.start_server.
"""

import asyncio
import dataclasses
import inspect
import logging

import grpc
from google.protobuf.message import DecodeError

log = logging.getLogger(__name__)

# What a client that sent bytes which do not parse is told (no parser internals).
UNPARSEABLE_MESSAGE = "the request's bytes do not parse as {name}"
INTERNAL_MESSAGE = "internal error"


class _Unparseable:
    """The request value of bytes that did not parse: the method's name, for the status."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name


def safe_deserializer(deserialize, name: str):
    """deserialize(bytes), or an _Unparseable marker where the bytes do not parse."""
    if deserialize is None:
        return None

    def parse(data: bytes):
        try:
            return deserialize(data)
        except DecodeError:
            return _Unparseable(name)

    return parse


async def _refuse(context: grpc.aio.ServicerContext, marker: _Unparseable) -> None:
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, UNPARSEABLE_MESSAGE.format(name=marker.name))


async def _internal(context: grpc.aio.ServicerContext, method: str) -> None:
    log.exception("handler of %s failed", method)
    await context.abort(grpc.StatusCode.INTERNAL, INTERNAL_MESSAGE)


# What must pass through untouched: gRPC's own abort and cancellation.
_PASS_THROUGH = (grpc.aio.AbortError, asyncio.CancelledError)


def _checked_requests(requests, context):
    """A streamed request iterator whose unparseable message ends the call with INVALID_ARGUMENT."""
    async def checked():
        async for request in requests:
            if isinstance(request, _Unparseable):
                await _refuse(context, request)
            yield request
    return checked()


def _wrap_behavior(behavior, method: str, request_streaming: bool):
    """behavior with unparseable requests refused and escaped exceptions answered INTERNAL."""
    def check(request, context):
        return _checked_requests(request, context) if request_streaming else request

    if inspect.isasyncgenfunction(behavior):
        async def stream(request, context):
            if isinstance(request, _Unparseable):
                await _refuse(context, request)
            try:
                async for response in behavior(check(request, context), context):
                    yield response
            except _PASS_THROUGH:
                raise
            except Exception:
                await _internal(context, method)
        return stream

    if inspect.iscoroutinefunction(behavior):
        async def call(request, context):
            if isinstance(request, _Unparseable):
                await _refuse(context, request)
            try:
                return await behavior(check(request, context), context)
            except _PASS_THROUGH:
                raise
            except Exception:
                await _internal(context, method)
        return call
    return behavior  # a synchronous handler (none in the mesh): left to gRPC


def handler_kind(handler: grpc.RpcMethodHandler) -> str:
    """The name of the handler's behaviour field: "unary_unary", "unary_stream", ..."""
    return ("stream" if handler.request_streaming else "unary") + "_" + \
        ("stream" if handler.response_streaming else "unary")


class HostileInputInterceptor(grpc.aio.ServerInterceptor):
    """Unparseable requests -> INVALID_ARGUMENT, escaped exceptions -> INTERNAL "internal error"."""

    def __init__(self, methods_prefix: str = "/") -> None:
        # Only methods whose path starts with this (e.g. "/moe.gateway.v1.") are wrapped.
        self._prefix = methods_prefix

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or not method.startswith(self._prefix):
            return handler
        kind = handler_kind(handler)
        behavior = getattr(handler, kind)
        name = method.rsplit("/", 1)[-1]
        return handler._replace(
            request_deserializer=safe_deserializer(handler.request_deserializer, name),
            **{kind: _wrap_behavior(behavior, method, handler.request_streaming)})


@dataclasses.dataclass(frozen=True, slots=True)
class ServerLimits:
    """Explicit bounds of one gRPC server. A role's config exposes them as flags (the gateway's:
    gateway/config.py, documented in docs/configuration.md and docs/security.md)."""

    max_message_bytes: int = 64 * 1024 * 1024  # received and sent
    max_concurrent_streams: int = 1024  # per client connection
    max_metadata_bytes: int = 16 * 1024  # request headers
    keepalive_time_s: float = 60.0  # the server pings a connection idle this long ...
    keepalive_timeout_s: float = 20.0  # ... and drops it if the ping is not answered in this
    min_ping_interval_s: float = 10.0  # clients pinging more often are disconnected
    permit_keepalive_without_calls: bool = False
    max_connection_idle_s: float = 0.0  # GOAWAY to a connection without calls this long; 0: never

    def __post_init__(self) -> None:
        for name in ("max_message_bytes", "max_concurrent_streams", "max_metadata_bytes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        for name in ("keepalive_time_s", "keepalive_timeout_s", "min_ping_interval_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if not self.max_connection_idle_s >= 0:
            raise ValueError(f"max_connection_idle_s must be >= 0, got {self.max_connection_idle_s}")

    def options(self) -> list[tuple[str, int]]:
        """The grpc server options of these limits."""
        options = [
            ("grpc.max_receive_message_length", self.max_message_bytes),
            ("grpc.max_send_message_length", self.max_message_bytes),
            ("grpc.max_concurrent_streams", self.max_concurrent_streams),
            ("grpc.max_metadata_size", self.max_metadata_bytes),
            ("grpc.absolute_max_metadata_size", self.max_metadata_bytes),
            ("grpc.keepalive_time_ms", _ms(self.keepalive_time_s)),
            ("grpc.keepalive_timeout_ms", _ms(self.keepalive_timeout_s)),
            ("grpc.http2.min_ping_interval_without_data_ms", _ms(self.min_ping_interval_s)),
            ("grpc.http2.max_ping_strikes", 2),
            ("grpc.keepalive_permit_without_calls", int(self.permit_keepalive_without_calls)),
        ]
        if self.max_connection_idle_s:
            options.append(("grpc.max_connection_idle_ms", _ms(self.max_connection_idle_s)))
        return options


def _ms(seconds: float) -> int:
    return max(1, round(seconds * 1000))
