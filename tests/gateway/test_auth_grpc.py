"""The API key interceptor (gateway/auth_grpc.py) on a real grpc.aio server, over a stand-in
GenerationService whose methods are of every shape (a generator, a handler that writes)."""

import asyncio
import json

import grpc

from gateway.auth import KeyStore, hash_key, new_key
from gateway.auth_grpc import ApiKeyInterceptor
from moe.gateway.v1 import gateway_pb2
from services import grpc_limits, grpc_util

SERVICE = "moe.gateway.v1.GenerationService"


async def _generate(request, context):
    yield gateway_pb2.GenerateResponse(request_id=request.request_id)


async def _written(request, context):  # a method added later, writing with context.write
    await context.write(gateway_pb2.GenerateResponse(request_id="written"))


def _add_service(server) -> None:
    parse, write = gateway_pb2.GenerateRequest.FromString, gateway_pb2.GenerateResponse.SerializeToString
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {
        "Generate": grpc.unary_stream_rpc_method_handler(_generate, parse, write),
        "Written": grpc.unary_stream_rpc_method_handler(_written, parse, write),
    }),))


async def _calls(store: KeyStore, key: str):
    server = await grpc_util.start_server(
        [_add_service], [SERVICE], interceptors=[ApiKeyInterceptor(store), grpc_limits.HostileInputInterceptor()])
    results = {}
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            for method in ("Generate", "Written"):
                call = channel.unary_stream(f"/{SERVICE}/{method}",
                                            request_serializer=gateway_pb2.GenerateRequest.SerializeToString,
                                            response_deserializer=gateway_pb2.GenerateResponse.FromString)
                for name, metadata in (("none", ()), ("key", (("authorization", f"Bearer {key}"),)),
                                       ("batch", (("authorization", f"Bearer {key}"),))):
                    request = gateway_pb2.GenerateRequest(
                        request_id="r", priority=gateway_pb2.PRIORITY_BATCH if name == "batch" else 0)
                    try:
                        results[method, name] = [r.request_id async for r in call(request, metadata=metadata,
                                                                                  timeout=10)]
                    except grpc.aio.AioRpcError as error:
                        results[method, name] = error.code()
    finally:
        await server.stop(0)
    return results


def test_every_method_needs_a_key_and_generate_its_class_and_a_stream(tmp_path):
    key = new_key()
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"keys": [{"name": "k", "sha256": hash_key(key), "priorities": ["interactive"],
                                          "max_streams": 1}]}))
    store = KeyStore(str(path))
    results = asyncio.run(_calls(store, key))
    assert results == {
        ("Generate", "none"): grpc.StatusCode.UNAUTHENTICATED,
        ("Generate", "key"): ["r"],
        ("Generate", "batch"): grpc.StatusCode.PERMISSION_DENIED,
        ("Written", "none"): grpc.StatusCode.UNAUTHENTICATED,
        ("Written", "key"): ["written"],
        ("Written", "batch"): ["written"],  # only Generate has classes
    }
    # Each finished Generate gave its stream back: the key's one stream is free.
    store.open_stream(store.authenticate(key))()
