"""Operations on the hosts of a plan, every host in parallel, and the cluster's lifecycle built
from them. `parallel` is the one way to act on every host at once (`HostOps.each_host`: per-host
outcomes, one combined HostFailure); `launcher` talks to dtf's launcher on a host; by concern:
`start` (with `environments`, the managed environments), `syncing` (packs to hosts), `status`,
`lease`, `reach` (the mesh check, unreachable tasks), `stop`, `slurm` (a Slurm allocation: submit, wait,
cancel; tasks as job steps), `repair` (under `dtf train`: dead tasks started again, a lost host's
tasks moved to a spare); `lifecycle` is `dtf up` (with its
rollback), repair, `dtf down`, `dtf sync` and the record they keep. Nothing here prints: progress
goes through a callback. It may import dtf.errors, dtf.files, dtf.cluster, dtf.hosts and
dtf_server.
"""
