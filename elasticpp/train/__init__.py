"""The training engine: model, tensor/pipeline/data parallelism, schedules, worker process.

Imports torch, `elasticpp.plan`, `elasticpp.checkpoint` and `elasticpp.errors` only — never
etcd or gRPC; the node agent drives workers through `worker` / `procs`.
"""
