"""The Backoff gRPC service as Ray Serve's gRPC proxy registers it (`grpc_servicer_functions`).

The same methods and messages as the generated `clients.backoff_pb2_grpc` adder, with one
difference: a request that does not parse (bytes that are not a message of its type, a
string field that is not UTF-8) becomes `Undecodable` instead of an exception inside the
proxy, which gRPC would report as INTERNAL. The Ingress answers it INVALID_ARGUMENT: a
client's mistake is never a server error. No Ray here.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc
from google.protobuf.message import DecodeError

from clients import backoff_pb2 as pb

SERVICE = "backoff.Backoff"


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
            servicer.Generate, request_deserializer=_lenient(pb.GenerateRequest),
            response_serializer=pb.GenerateResponse.SerializeToString),
        "GenerateStream": grpc.unary_stream_rpc_method_handler(
            servicer.GenerateStream, request_deserializer=_lenient(pb.GenerateRequest),
            response_serializer=pb.GenerateChunk.SerializeToString),
        "Models": grpc.unary_unary_rpc_method_handler(
            servicer.Models, request_deserializer=_lenient(pb.ModelsRequest),
            response_serializer=pb.ModelsResponse.SerializeToString),
        "Health": grpc.unary_unary_rpc_method_handler(
            servicer.Health, request_deserializer=_lenient(pb.HealthRequest),
            response_serializer=pb.HealthResponse.SerializeToString),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, methods),))
