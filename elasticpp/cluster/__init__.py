"""Cluster state on etcd v3: membership leases, leader election, plan generations, barriers,
commit records and suspicion. The only package that talks to etcd (through `etcd.kv`).

Modules: `client` (`ClusterClient`: spec, epoch, membership, election, generations,
watches; it holds the objects below), `reads` (`JobReads`: the reads, the cache and the
skipped-value count they share), `arrivals` (barriers, the resume instruction, suspicion:
`client.arrivals`), `commits` (commit records, the safe step, housekeeping:
`client.commits`), `health` (quarantines, the job's end: `client.health`), `leases`
(membership and leadership keys under leases), `watch` (watches that survive etcd
restarts), `records` (the versioned values), `keys` (the key layout), `etcd/` (the etcd v3
client itself, which knows no job).
Import each name from its module (`elasticpp.cluster.client.ClusterClient`, ...): this
package imports nothing, so a pure module that reads `records` or `keys` loads no gRPC.
`EtcdServer` is in `elasticpp.cluster.etcd.server` (it starts a local etcd for tests and the
demo).
"""
