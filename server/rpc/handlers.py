"""The service's handler table, built from the proto's own service descriptor.

Every method of ``loaderd.v1.Loader`` is registered with an identity request
deserializer: the handler gets the raw bytes and parses them here, so a
malformed request is answered INVALID_ARGUMENT by our code (naming the message
type) instead of failing inside grpcio's deserialization path, which leaks
memory per failed request (grpc/grpc#36908; tests/integration/test_fuzz.py checks RSS).
Streaming methods get an iterator of parsed messages that raises
``BadRequestError`` at a malformed one. A method listed in ``raw_responses``
returns bytes already in the wire format (loaderd.wire.framing), so it is
registered with an identity serializer.

The standard services the daemon also serves (health, reflection) come with
generated ``add_*_to_server`` functions that register protobuf deserializers,
so garbage sent to them leaked the same way; ``add_parsing`` registers them
with their handlers rewrapped to parse inside (INVALID_ARGUMENT on garbage).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator
from typing import Any

import grpc
from google.protobuf import message_factory
from google.protobuf.message import DecodeError, Message

from loaderd.server.rpc.requests import BadRequestError
from loaderd.v1 import loaderd_pb2 as pb
from loaderd.wire.reasons import Reason, abort

SERVICE = pb.DESCRIPTOR.services_by_name["Loader"]
SERVICE_NAME = SERVICE.full_name

_KINDS: dict[tuple[bool, bool], Callable[..., grpc.RpcMethodHandler]] = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


def parse(cls: type[Message], data: bytes) -> Any:
    """``data`` as a ``cls`` message; BadRequestError if it is not one."""
    try:
        return cls.FromString(data)
    except (DecodeError, RuntimeError, ValueError):
        raise BadRequestError(f"malformed request: {len(data)} bytes that are not a {cls.DESCRIPTOR.full_name}") from None


def parse_each(cls: type[Message], requests: Iterator[bytes]) -> Iterator[Any]:
    """The messages of a request stream, parsed one by one (BadRequestError at a malformed one)."""
    for data in requests:
        yield parse(cls, data)


def _unary(method: Callable[..., Any], cls: type[Message]) -> Callable[..., Any]:
    def handle(data: bytes, context: grpc.ServicerContext) -> Any:
        try:
            request = parse(cls, data)
        except BadRequestError as exc:
            abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc), Reason.BAD_REQUEST)
        return method(request, context)

    return handle


def _streaming(method: Callable[..., Any], cls: type[Message]) -> Callable[..., Any]:
    def handle(requests: Iterator[bytes], context: grpc.ServicerContext) -> Any:
        return method(parse_each(cls, requests), context)

    return handle


def generic_handler(servicer: Any, raw_responses: Collection[str] = ()) -> grpc.GenericRpcHandler:
    """A handler for every method of the service, each calling ``servicer.<MethodName>``."""
    handlers = {}
    for method in SERVICE.methods:
        request = message_factory.GetMessageClass(method.input_type)
        response = message_factory.GetMessageClass(method.output_type)
        wrap = _streaming if method.client_streaming else _unary
        make = _KINDS[(method.client_streaming, method.server_streaming)]
        handlers[method.name] = make(
            wrap(getattr(servicer, method.name), request),
            request_deserializer=None,
            response_serializer=bytes if method.name in raw_responses else response.SerializeToString,
        )
    return grpc.method_handlers_generic_handler(SERVICE_NAME, handlers)


def _parse_or_abort(parse: Callable[[bytes], Any], data: bytes, context: grpc.ServicerContext) -> Any:
    try:
        return parse(data)
    except (DecodeError, RuntimeError, ValueError):
        abort(context, grpc.StatusCode.INVALID_ARGUMENT, f"malformed request: {len(data)} bytes that do not parse", Reason.BAD_REQUEST)


def _parse_each_or_abort(parse: Callable[[bytes], Any], requests: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[Any]:
    for data in requests:
        yield _parse_or_abort(parse, data, context)


def parse_in_handler(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """``handler`` registered with an identity deserializer, parsing inside the handler instead."""
    parse = handler.request_deserializer
    if parse is None:
        return handler

    def wrap(behavior: Callable[..., Any]) -> Callable[..., Any]:
        if handler.request_streaming:
            return lambda requests, context: behavior(_parse_each_or_abort(parse, requests, context), context)
        return lambda data, context: behavior(_parse_or_abort(parse, data, context), context)

    kinds = ("unary_unary", "unary_stream", "stream_unary", "stream_stream")
    rewrapped = {kind: wrap(getattr(handler, kind)) for kind in kinds if getattr(handler, kind) is not None}
    return handler._replace(request_deserializer=None, **rewrapped)


class _Capture:
    """Stands in for a server to catch the handler table a generated ``add_*_to_server`` registers."""

    def __init__(self) -> None:
        self.service = ""
        self.handlers: dict[str, grpc.RpcMethodHandler] = {}

    def add_generic_rpc_handlers(self, handlers: Any) -> None:
        pass

    def add_registered_method_handlers(self, service: str, handlers: dict[str, grpc.RpcMethodHandler]) -> None:
        self.service, self.handlers = service, handlers


def add_parsing(add_to_server: Callable[[Any, Any], None], servicer: Any, server: grpc.Server) -> None:
    """``add_to_server(servicer, server)`` (a generated ``add_*Servicer_to_server``) with every method parsing inside."""
    capture = _Capture()
    add_to_server(servicer, capture)
    handlers = {name: parse_in_handler(handler) for name, handler in capture.handlers.items()}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(capture.service, handlers),))
