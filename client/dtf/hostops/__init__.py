"""Operations on the hosts of a plan, every host in parallel, and the cluster's lifecycle built
from them: starting the servers (with managed environments and the firewall), sending packs,
status, the lease, the mesh check, stopping; `lifecycle` is `dtf up` (with its rollback), repair,
`dtf down`, `dtf sync` and the record they keep. Nothing here prints: progress goes through a
callback. It may import dtf.errors, dtf.files, dtf.cluster, dtf.hosts and dtf_server.
"""
