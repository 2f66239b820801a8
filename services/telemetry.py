"""OpenTelemetry tracing for every role: setup from the standard OTEL_* variables,
trace context in gRPC metadata and in the step protocol, spans around control calls.

Setup (`configure_tracing`, called once per process by `process.run_role`
and the expert service's main): tracing is on only when an OTLP endpoint is
configured (`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` or
`OTEL_EXPORTER_OTLP_ENDPOINT`), the SDK is not disabled (`OTEL_SDK_DISABLED`)
and `OTEL_TRACES_EXPORTER` is not `none`. Then spans go through a
BatchSpanProcessor (`OTEL_BSP_*`) to the OTLP gRPC exporter; the sampler is
the SDK's from `OTEL_TRACES_SAMPLER`/`OTEL_TRACES_SAMPLER_ARG` (default
parentbased_always_on), and `OTEL_SERVICE_NAME` defaults to `moemesh-<role>`
(the name the deploy manifests set). When tracing is off nothing is
installed: the global tracer stays OpenTelemetry's no-op tracer, no gRPC
interceptor is added, and the hooks on the step path are skipped with one
`is None` check, so the decode path allocates nothing for tracing.

Propagation: W3C `traceparent` (the global propagator, `OTEL_PROPAGATORS`).
- Server side, `TracingServerInterceptor` (installed by grpc_util.start_server)
  extracts the caller's context from the call's metadata and runs each call in
  a SERVER span `<package.Service>/<Method>`. The health and reflection
  services are left alone (health's Watch writes with context.write(), which a
  wrapping interceptor breaks), and so is ExpertService/ExecuteSteps: one
  stream lives as long as the worker group, so a span around it means
  nothing; the requests' contexts travel per sequence instead
  (`NewSequence.traceparent`, see gateway/observability.py and
  expert_svc/observability.py). Streaming handlers must be async generators.
- Client side, `TracingClientInterceptor` (installed by grpc_util.channel) puts
  a CLIENT span around each unary call and its context in the metadata
  (health checks excepted: followers probe the leader many times a second).

`traced(name)` puts an INTERNAL span around an async function: the control
calls (registration, election, placement, joining a group) use it.
"""

import contextlib
import dataclasses
import functools
import inspect
import logging
import os
import threading
from collections.abc import Mapping

import grpc
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.propagators.textmap import Getter
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

log = logging.getLogger(__name__)

TRACER_NAME = "moemesh"
# Services whose calls get no server span (see the module docstring).
UNTRACED_SERVICES = frozenset({"grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection",
                               "grpc.reflection.v1.ServerReflection"})
UNTRACED_METHODS = frozenset({"/moe.expert.v1.ExpertService/ExecuteSteps"})
# Server span status for these codes is Error (OpenTelemetry's gRPC semantic conventions).
_SERVER_ERROR_CODES = frozenset({grpc.StatusCode.UNKNOWN, grpc.StatusCode.DEADLINE_EXCEEDED,
                                 grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.INTERNAL,
                                 grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DATA_LOSS})
_W3C = TraceContextTextMapPropagator()


@dataclasses.dataclass(slots=True)
class _Tracing:
    provider: object | None = None  # the SDK TracerProvider while tracing is on


_state = _Tracing()


def otlp_endpoint(env: Mapping[str, str] | None = None) -> str | None:
    """The OTLP traces endpoint tracing exports to, or None if tracing is off."""
    env = os.environ if env is None else env
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    if env.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower() in ("none", ""):
        return None
    endpoint = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    return endpoint.strip() if endpoint and endpoint.strip() else None


def configure_tracing(role: str, env: Mapping[str, str] | None = None) -> bool:
    """Sets up the global tracer provider from the OTEL_* variables; returns
    True if tracing is on. Call once, before any gRPC server or channel exists."""
    endpoint = otlp_endpoint(env)
    if endpoint is None or _state.provider is not None:
        return _state.provider is not None
    # The SDK is imported only when tracing is on.
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    env = os.environ if env is None else env
    attributes = {"moemesh.role": role}
    if not env.get("OTEL_SERVICE_NAME"):
        attributes[SERVICE_NAME] = f"moemesh-{role}"
    # shutdown_tracing() stops it, bounded; the SDK's own atexit shutdown could wait 30 s.
    provider = TracerProvider(resource=Resource.create(attributes), shutdown_on_exit=False)
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)
    _state.provider = provider
    log.info("tracing on: OTLP/gRPC to %s, service %s", endpoint,
             provider.resource.attributes.get(SERVICE_NAME))
    return True


def shutdown_tracing(timeout_s: float = 5.0) -> None:
    """Exports the spans still buffered and stops tracing (at process exit),
    giving up after timeout_s: an unreachable collector must not hold up a
    stopping process (the exporter alone may retry for longer)."""
    provider, _state.provider = _state.provider, None
    if provider is None:
        return

    def flush_and_stop() -> None:
        provider.force_flush(int(timeout_s * 1000))
        provider.shutdown()

    worker = threading.Thread(target=flush_and_stop, name="otel-shutdown", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        log.warning("spans not exported within %.1f s of stopping are dropped", timeout_s)


def is_enabled() -> bool:
    """True once configure_tracing turned tracing on."""
    return _state.provider is not None


def tracer() -> trace.Tracer:
    """The mesh's tracer (OpenTelemetry's no-op tracer while tracing is off)."""
    return trace.get_tracer(TRACER_NAME)


def traced(name: str, **attributes):
    """Decorates an async function: while tracing is on, each call runs in an
    INTERNAL span `name` (exceptions recorded); off, one flag check."""

    def decorate(fn):
        assert inspect.iscoroutinefunction(fn), fn

        @functools.wraps(fn)
        async def wrapper(*args, **kwargs):
            if _state.provider is None:
                return await fn(*args, **kwargs)
            with tracer().start_as_current_span(name, attributes=attributes):
                return await fn(*args, **kwargs)

        return wrapper

    return decorate


# --- trace context as a string (the step protocol's NewSequence.traceparent) ---

def traceparent_of(span: trace.Span) -> str:
    """The W3C traceparent header of a span ("" for a non-recording one)."""
    if not span.get_span_context().is_valid:
        return ""
    carrier: dict[str, str] = {}
    _W3C.inject(carrier, context=trace.set_span_in_context(span))
    return carrier.get("traceparent", "")


def context_from_traceparent(traceparent: str) -> otel_context.Context | None:
    """The context a traceparent header carries, None if empty or malformed."""
    if not traceparent:
        return None
    ctx = _W3C.extract({"traceparent": traceparent})
    return ctx if trace.get_current_span(ctx).get_span_context().is_valid else None


def trace_id_from_traceparent(traceparent: str) -> str:
    """The 32-hex-digit trace id of a traceparent header, "" if there is none."""
    parts = traceparent.split("-")
    return parts[1] if len(parts) == 4 and len(parts[1]) == 32 else ""


# --- gRPC metadata ---

class _MetadataGetter(Getter):
    """Reads keys out of gRPC metadata: a sequence of (key, value) pairs."""

    def get(self, carrier, key):
        values = [value for k, value in carrier if k == key]
        return values or None

    def keys(self, carrier):
        return [k for k, _ in carrier]


_GETTER = _MetadataGetter()


def context_from_metadata(metadata) -> otel_context.Context:
    """The caller's trace context in a call's invocation metadata."""
    return propagate.extract(metadata or (), getter=_GETTER)


def metadata_value(metadata, key: str) -> str:
    """The first value of key in gRPC metadata, "" if absent."""
    return next((value for k, value in metadata or () if k == key), "")


class TracingServerInterceptor(grpc.aio.ServerInterceptor):
    """A SERVER span per call, child of the caller's context (see the module docstring)."""

    def __init__(self, untraced_services=UNTRACED_SERVICES, untraced_methods=UNTRACED_METHODS):
        self._untraced_services = frozenset(untraced_services)
        self._untraced_methods = frozenset(untraced_methods)

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method in self._untraced_methods or \
                method[1:].partition("/")[0] in self._untraced_services:
            return handler
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(
                _traced_unary(method, handler.unary_unary),
                handler.request_deserializer, handler.response_serializer)
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(
                _traced_unary(method, handler.stream_unary),
                handler.request_deserializer, handler.response_serializer)
        if handler.unary_stream and inspect.isasyncgenfunction(handler.unary_stream):
            return grpc.unary_stream_rpc_method_handler(
                _traced_stream(method, handler.unary_stream),
                handler.request_deserializer, handler.response_serializer)
        if handler.stream_stream and inspect.isasyncgenfunction(handler.stream_stream):
            return grpc.stream_stream_rpc_method_handler(
                _traced_stream(method, handler.stream_stream),
                handler.request_deserializer, handler.response_serializer)
        return handler  # a context.write() streaming handler: wrapping would break it


def _server_span(method: str, context: grpc.aio.ServicerContext):
    service, _, name = method[1:].partition("/")
    return tracer().start_as_current_span(
        method[1:], context=context_from_metadata(context.invocation_metadata()), kind=SpanKind.SERVER,
        attributes={"rpc.system": "grpc", "rpc.service": service, "rpc.method": name},
        set_status_on_exception=False)


def _end_server_span(span: trace.Span, context: grpc.aio.ServicerContext, error: BaseException | None) -> None:
    code = context.code()
    if code is None or isinstance(code, int):
        code = grpc.StatusCode.OK if error is None else grpc.StatusCode.UNKNOWN
    span.set_attribute("rpc.grpc.status_code", code.value[0])
    if code in _SERVER_ERROR_CODES:
        span.set_status(Status(StatusCode.ERROR, str(context.details() or code.name)))


@contextlib.contextmanager
def _server_call(method: str, context: grpc.aio.ServicerContext):
    """The SERVER span of one call, ended with the call's status code."""
    with _server_span(method, context) as span:
        error = None
        try:
            yield
        except BaseException as caught:
            error = caught
            raise
        finally:
            _end_server_span(span, context, error)


def _traced_unary(method: str, behavior):
    async def handle(request, context):
        with _server_call(method, context):
            return await behavior(request, context)

    return handle


def _traced_stream(method: str, behavior):
    async def handle(request, context):
        with _server_call(method, context):
            async for response in behavior(request, context):
                yield response

    return handle


class TracingClientInterceptor(grpc.aio.UnaryUnaryClientInterceptor):
    """A CLIENT span around each unary call, its context sent in the metadata."""

    async def intercept_unary_unary(self, continuation, client_call_details, request):
        method = client_call_details.method
        if isinstance(method, bytes):
            method = method.decode()
        if method[1:].partition("/")[0] in UNTRACED_SERVICES:
            return await continuation(client_call_details, request)
        service, _, name = method[1:].partition("/")
        with tracer().start_as_current_span(
                method[1:], kind=SpanKind.CLIENT, set_status_on_exception=False,
                attributes={"rpc.system": "grpc", "rpc.service": service, "rpc.method": name}) as span:
            carrier: dict[str, str] = {}
            propagate.inject(carrier)
            metadata = [*(client_call_details.metadata or ()), *carrier.items()]
            details = grpc.aio.ClientCallDetails(
                client_call_details.method, client_call_details.timeout, grpc.aio.Metadata(*metadata),
                client_call_details.credentials, client_call_details.wait_for_ready)
            call = await continuation(details, request)
            code = await call.code()
            span.set_attribute("rpc.grpc.status_code", code.value[0])
            if code is not grpc.StatusCode.OK:
                span.set_status(Status(StatusCode.ERROR, code.name))
            return call


def server_interceptors() -> list[grpc.aio.ServerInterceptor]:
    """The server interceptors tracing needs: none while it is off."""
    return [TracingServerInterceptor()] if is_enabled() else []


def client_interceptors() -> list[grpc.aio.ClientInterceptor]:
    """The channel interceptors tracing needs: none while it is off."""
    return [TracingClientInterceptor()] if is_enabled() else []
