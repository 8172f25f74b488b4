"""Generated protobuf/gRPC code (tools/gen_proto.py); imported only by its servers and callers."""
