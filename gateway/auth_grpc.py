"""API keys on the gateway's gRPC API: a server interceptor over the key store (gateway/auth.py).

Every call of moe.gateway.v1.GenerationService needs `authorization: Bearer KEY` metadata
(health and reflection stay open: probes and load balancers carry no key). Each call counts
against its key's rate; a Generate call is also checked against the key's priority classes and
holds one of its streams until it ends. Refusals are UNAUTHENTICATED, PERMISSION_DENIED, or
RESOURCE_EXHAUSTED with the trailing metadata `retry-after-ms` (when a retry can succeed).
The key's name (never the key) is what logs see.
"""

import inspect
import logging
from collections.abc import Callable

import grpc

from gateway.auth import AuthCode, AuthError, KeyStore, bearer_token, caller_key_name
from moe.gateway.v1 import gateway_pb2
from services.grpc_limits import handler_kind

log = logging.getLogger("gateway.auth")

SERVICE_PREFIX = "/" + gateway_pb2.DESCRIPTOR.services_by_name["GenerationService"].full_name + "/"
GENERATE = SERVICE_PREFIX + "Generate"
RETRY_AFTER_KEY = "retry-after-ms"

_STATUS = {
    AuthCode.UNAUTHENTICATED: grpc.StatusCode.UNAUTHENTICATED,
    AuthCode.PERMISSION_DENIED: grpc.StatusCode.PERMISSION_DENIED,
    AuthCode.RESOURCE_EXHAUSTED: grpc.StatusCode.RESOURCE_EXHAUSTED,
}
_PRIORITY_NAMES = {gateway_pb2.PRIORITY_BATCH: "batch"}


def priority_name(request) -> str:
    """The class a GenerateRequest asks for: "batch" or "interactive" (also for unset or unknown
    values: validation refuses those)."""
    return _PRIORITY_NAMES.get(getattr(request, "priority", 0), "interactive")


def _token(context: grpc.aio.ServicerContext) -> str | None:
    for key, value in context.invocation_metadata() or ():
        if key == "authorization":
            return bearer_token(value)
    return None


async def _refuse(context: grpc.aio.ServicerContext, error: AuthError, method: str) -> None:
    trailing = ()
    if error.retry_after_s is not None:
        trailing = ((RETRY_AFTER_KEY, str(max(1, round(error.retry_after_s * 1000)))),)
    log.info("refused %s: %s", method.rsplit("/", 1)[-1], error.message)
    await context.abort(_STATUS[error.code], error.message, trailing_metadata=trailing)


def _no_stream() -> None:
    pass


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Authenticates and limits every call of GenerationService against a KeyStore."""

    def __init__(self, store: KeyStore) -> None:
        self.store = store

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or not method.startswith(SERVICE_PREFIX):
            return handler
        # Every method of the service, whatever its kind: a method added later is never open.
        kind = handler_kind(handler)
        behavior = getattr(handler, kind)
        wrapped = self._stream(behavior, method) if handler.response_streaming else self._unary(behavior, method)
        return handler._replace(**{kind: wrapped})

    def _unary(self, behavior, method: str):
        store = self.store

        async def call(request, context):
            try:
                key = store.authenticate(_token(context))
                store.take_request(key)
            except AuthError as error:
                await _refuse(context, error, method)
            caller_key_name.set(key.name)
            return await behavior(request, context)

        return call

    def _stream(self, behavior, method: str):
        """A streamed answer: Generate is checked against the key's classes and holds one of its
        streams; other streaming methods count against the rate only."""
        store = self.store
        is_generate = method == GENERATE

        async def admit(request, context) -> Callable[[], None]:
            try:
                key = store.authenticate(_token(context))
                caller_key_name.set(key.name)
                if is_generate:
                    return store.admit_generate(key, priority_name(request))
                store.take_request(key)
                return _no_stream
            except AuthError as error:
                await _refuse(context, error, method)

        async def stream(request, context):
            close = await admit(request, context)
            try:
                async for response in behavior(request, context):
                    yield response
            finally:
                close()

        async def written(request, context):  # a handler that writes with context.write
            close = await admit(request, context)
            try:
                return await behavior(request, context)
            finally:
                close()

        return stream if inspect.isasyncgenfunction(behavior) else written
