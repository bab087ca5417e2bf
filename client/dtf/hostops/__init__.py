"""Operations on the hosts of a plan, every host in parallel, and the cluster's lifecycle built
from them, each host reached through the plan's provider (dtf.providers). `parallel` is the one
way to act on every host at once (`HostOps.each_host`: per-host outcomes, one combined
HostFailure; `HostOps.runner` a host's runner); `launcher` talks to dtf's launcher on a host; by
concern: `start` (with `environments`, the managed environments), `syncing` (packs to hosts),
`status`, `lease`, `reach` (the mesh check, unreachable tasks), `stop`, `repair` (under `dtf
train`: dead tasks started again, a lost host's tasks moved to a spare, a retired host's old
tasks stopped), `realloc` (a new allocation for one that ended under `dtf train`); `lifecycle` is
`dtf up` (with its rollback), repair, `dtf down`, `dtf sync` and the record they keep. Nothing here
prints: progress goes through a callback. It may import dtf.errors, dtf.files, dtf.cluster,
dtf.hosts, dtf.providers and dtf_server (its protocol).
"""
