"""The balanceroute.v1 protobuf and gRPC modules, generated from proto/balanceroute/v1 by
grpcio-tools when the package is built (setup.py); the package path mirrors the proto package,
so the generated imports (`from balanceroute.v1 import types_pb2`) resolve as they are."""
