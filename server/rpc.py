"""The service's handler table, built from the proto's own service descriptor.

Every method of ``loaderd.v1.Loader`` is registered with its request and
response classes as the descriptor names them; a method listed in
``raw_responses`` returns bytes already in the wire format
(loaderd.wire.framing), so it is registered with an identity serializer.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

import grpc
from google.protobuf import message_factory

from loaderd.v1 import loaderd_pb2 as pb

SERVICE = pb.DESCRIPTOR.services_by_name["Loader"]
SERVICE_NAME = SERVICE.full_name

_KINDS: dict[tuple[bool, bool], Callable[..., grpc.RpcMethodHandler]] = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


def generic_handler(servicer: Any, raw_responses: Collection[str] = ()) -> grpc.GenericRpcHandler:
    """A handler for every method of the service, each calling ``servicer.<MethodName>``."""
    handlers = {}
    for method in SERVICE.methods:
        request = message_factory.GetMessageClass(method.input_type)
        response = message_factory.GetMessageClass(method.output_type)
        make = _KINDS[(method.client_streaming, method.server_streaming)]
        handlers[method.name] = make(
            getattr(servicer, method.name),
            request_deserializer=request.FromString,
            response_serializer=bytes if method.name in raw_responses else response.SerializeToString,
        )
    return grpc.method_handlers_generic_handler(SERVICE_NAME, handlers)
