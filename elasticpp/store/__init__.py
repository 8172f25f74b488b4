"""The node's keep of committed steps, peer transfer, replication, persistence, resolver.

Never imports etcd or `elasticpp.cluster` (the agent wires them). The modules that need gRPC
(`service`, `client`, `replicate`, `resume`) import it; `local`, `holdings`, `resolver`,
`persist` and `checkpoints` do not, and nothing here imports torch: pieces are opaque files
with a sha256.
"""
