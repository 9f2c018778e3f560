"""The Backoff gRPC service as Ray Serve's gRPC proxy registers it (`grpc_servicer_functions`).

The same methods and messages as the generated `clients.wire.backoff_pb2_grpc` adder, with one
difference: a request that does not parse (bytes that are not a message of its type, a
string field that is not UTF-8) becomes `Undecodable` instead of an exception inside the
proxy, which gRPC would report as INTERNAL. The Ingress answers it INVALID_ARGUMENT: a
client's mistake is never a server error. No Ray here.

A refused *stream* reaches its client only as an exception raised after the status is set
(Serve's proxy sends a streamed status no other way), and Serve logs such an exception with
its traceback at ERROR twice: in the Ingress replica ("Request failed.") and in the proxy.
`RefusalLog`, installed on Serve's logger by importing this module (both processes do: the
proxy to register the service, the Ingress for `Undecodable`), makes that one WARNING line.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import grpc
from google.protobuf.message import DecodeError

from clients.wire import backoff_pb2 as pb

SERVICE = "backoff.Backoff"
SERVE_LOGGER = "ray.serve"  # ray.serve._private.constants.SERVE_LOGGER_NAME
# the statuses of a refusal (the client's mistake, or a full server): not server errors
REFUSALS = frozenset(
    {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.OUT_OF_RANGE,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.PERMISSION_DENIED,
    }
)


class RefusalLog(logging.Filter):
    """Serve's records of a request that failed with a refusal status its handler set
    (Serve wraps the exception as gRPCStatusError, which carries `grpc_code`): the replica's
    is dropped, the proxy's becomes one WARNING line without a traceback. Other records pass."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        code = getattr(exc, "grpc_code", None)
        if code not in REFUSALS:
            return True
        if record.getMessage() == "Request failed.":  # the replica's; the proxy logs the same request
            return False
        record.msg, record.args = "gRPC request refused: %s: %s", (code.name, getattr(exc, "grpc_details", "") or exc)
        record.levelno, record.levelname = logging.WARNING, "WARNING"
        record.exc_info = record.exc_text = record.stack_info = None
        return True


def quiet_refusals(logger: logging.Logger | None = None) -> None:
    """Install RefusalLog on Serve's logger (once)."""
    logger = logger or logging.getLogger(SERVE_LOGGER)
    if not any(isinstance(f, RefusalLog) for f in logger.filters):
        logger.addFilter(RefusalLog())


quiet_refusals()


@dataclass(frozen=True)
class Undecodable:
    """What a request that did not parse as `message` arrives as."""

    message: str
    reason: str

    def describe(self) -> str:
        return f"the request is not a valid {self.message}: {self.reason}"


def _lenient(message_type):
    def parse(data: bytes):
        try:
            return message_type.FromString(data)
        except (DecodeError, ValueError) as exc:  # upb raises DecodeError, also for bad UTF-8
            return Undecodable(message_type.DESCRIPTOR.full_name, str(exc) or type(exc).__name__)

    return parse


def add_BackoffServicer_to_server(servicer, server) -> None:  # noqa: N802 - the name gRPC adders have
    methods = {
        "Generate": grpc.unary_unary_rpc_method_handler(
            servicer.Generate,
            request_deserializer=_lenient(pb.GenerateRequest),
            response_serializer=pb.GenerateResponse.SerializeToString,
        ),
        "GenerateStream": grpc.unary_stream_rpc_method_handler(
            servicer.GenerateStream,
            request_deserializer=_lenient(pb.GenerateRequest),
            response_serializer=pb.GenerateChunk.SerializeToString,
        ),
        "Models": grpc.unary_unary_rpc_method_handler(
            servicer.Models,
            request_deserializer=_lenient(pb.ModelsRequest),
            response_serializer=pb.ModelsResponse.SerializeToString,
        ),
        "Health": grpc.unary_unary_rpc_method_handler(
            servicer.Health,
            request_deserializer=_lenient(pb.HealthRequest),
            response_serializer=pb.HealthResponse.SerializeToString,
        ),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, methods),))
