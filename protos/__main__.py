"""`python -m protos` regenerates the gRPC stubs."""

from protos import compile_protos

compile_protos()
print("generated protos/*_pb2.py")
