"""An etcd v3 client of its own: bounded calls with typed errors, watches that survive
restarts, lease keep-alives, TLS and authentication. It knows no job: what the job keeps in
etcd is `elasticpp.cluster`'s.

Modules: `kv` (`EtcdKV`, the calls), `endpoint` (one endpoint's channel and failover),
`ops` (request encoding), `errors` (gRPC status to typed errors), `security` (TLS, user,
token), `keepalive` (lease keep-alive streams), `watch_stream` and `watches` (watch streams),
`meter` (request counts, for benches), `server` (`EtcdServer`: a local etcd for tests and
the demo). This package imports nothing: import each name from its module.
"""
