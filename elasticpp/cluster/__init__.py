"""Cluster state on etcd v3: membership leases, leader election, plan generations, barriers,
commit records and suspicion. The only package that talks to etcd (through `etcd_client`).

Modules: `client` (the `ClusterClient` calls), `leases` (membership and leadership keys
under leases), `watch` (watches that survive etcd restarts), `arrivals` (barriers, the
resume instruction, suspicion), `commits` (commit records, the safe step, housekeeping),
`records` (the versioned values), `keys` (the key layout).
Import each name from its module (`elasticpp.cluster.client.ClusterClient`, ...): this
package imports nothing, so a pure module that reads `records` or `keys` loads no gRPC.
`EtcdServer` is in `elasticpp.cluster.etcd_server` (it starts a local etcd for tests and the
demo).
"""
