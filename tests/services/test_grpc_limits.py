"""services/grpc_limits.py on a real grpc.aio server: unparseable bytes, escaped exceptions, limits."""

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2

from services import grpc_limits, grpc_util

CHECK = "/grpc.health.v1.Health/Check"
WATCH = "/grpc.health.v1.Health/Watch"


async def _check(request, context):
    raise KeyError("secret internal state")


async def _watch(request, context):
    yield health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)
    raise RuntimeError("secret internal state")


def _add_broken(server) -> None:
    """test.Broken: handlers that fail with exceptions no code maps."""
    parse, write = health_pb2.HealthCheckRequest.FromString, health_pb2.HealthCheckResponse.SerializeToString
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("test.Broken", {
        "Check": grpc.unary_unary_rpc_method_handler(_check, parse, write),
        "Watch": grpc.unary_stream_rpc_method_handler(_watch, parse, write),
    }),))


async def _serve(is_broken: bool = False, limits=grpc_limits.ServerLimits()):
    register, names = ([_add_broken], ["test.Broken"]) if is_broken else ([], [])
    return await grpc_util.start_server(register, names, interceptors=[grpc_limits.HostileInputInterceptor()],
                                        options=limits.options())


async def _raw(port: int, method: str, payload: bytes, *, stream: bool = False, metadata=None):
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        try:
            if stream:
                call = channel.unary_stream(method)(payload, timeout=10, metadata=metadata)
                return None, [m async for m in call]
            return None, await channel.unary_unary(method)(payload, timeout=10, metadata=metadata)
        except grpc.aio.AioRpcError as error:
            return error.code(), error.details()


def test_unparseable_bytes_get_invalid_argument_without_parser_internals():
    async def run():
        server = await _serve()
        try:
            garbage = b"\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01"
            unary = await _raw(server.port, CHECK, garbage)
            stream = await _raw(server.port, WATCH, garbage, stream=True)
            # A length prefix far past the message: bytes that end inside the field.
            absurd = await _raw(server.port, CHECK, b"\x0a\xff\xff\xff\xff\x0fabc")
            good = await _raw(server.port, CHECK, health_pb2.HealthCheckRequest(service="").SerializeToString())
        finally:
            await server.stop(0)
        return unary, stream, absurd, good

    unary, stream, absurd, good = asyncio.run(run())
    for code, details in (unary, stream, absurd):
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, details)
        assert details == "the request's bytes do not parse as " + ("Watch" if details.endswith("Watch") else "Check")
        assert "DecodeError" not in details and "class" not in details
    assert good[0] is None


def test_an_exception_escaping_a_handler_is_internal_error_without_its_class_or_text(caplog):
    async def run():
        server = await _serve(is_broken=True)
        try:
            request = health_pb2.HealthCheckRequest().SerializeToString()
            return (await _raw(server.port, "/test.Broken/Check", request),
                    await _raw(server.port, "/test.Broken/Watch", request, stream=True))
        finally:
            await server.stop(0)

    unary, stream = asyncio.run(run())
    for code, details in (unary, stream):
        assert (code, details) == (grpc.StatusCode.INTERNAL, "internal error")
    assert "secret internal state" in caplog.text  # the operator sees it in the log


def test_oversized_messages_and_metadata_are_refused_and_the_server_keeps_serving():
    limits = grpc_limits.ServerLimits(max_message_bytes=1024, max_metadata_bytes=1024)

    async def run():
        server = await _serve(limits=limits)
        try:
            big = health_pb2.HealthCheckRequest(service="x" * 4096).SerializeToString()
            too_big = await _raw(server.port, CHECK, big)
            headers = await _raw(server.port, CHECK, b"", metadata=(("x-junk", "y" * 4096),))
            good = await _raw(server.port, CHECK, b"")
        finally:
            await server.stop(0)
        return too_big, headers, good

    too_big, headers, good = asyncio.run(run())
    assert too_big[0] == grpc.StatusCode.RESOURCE_EXHAUSTED, too_big
    assert headers[0] == grpc.StatusCode.RESOURCE_EXHAUSTED, headers
    assert good[0] is None


@pytest.mark.parametrize("field,value", [("max_message_bytes", 0), ("keepalive_time_s", 0.0),
                                         ("max_connection_idle_s", -1.0)])
def test_limits_are_checked(field, value):
    with pytest.raises(ValueError, match=field):
        grpc_limits.ServerLimits(**{field: value})


def test_limits_become_the_server_options():
    options = dict(grpc_limits.ServerLimits(max_concurrent_streams=7, max_connection_idle_s=2.5).options())
    assert options["grpc.max_concurrent_streams"] == 7
    assert options["grpc.max_connection_idle_ms"] == 2500
    assert options["grpc.keepalive_permit_without_calls"] == 0
