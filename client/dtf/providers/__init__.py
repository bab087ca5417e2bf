"""Providers: one place decides how each host of a cluster is reached. A `Provider` is built once
from a plan (`provider_for`, in `choose`, the one module that asks which kind of cluster it is): it
hands out each host's command runner (commands, files, streams, a TCP check from the host), opens
the training's route to the tasks, and holds what the cluster's hosts came from: the inventory's
hosts (`hosts.HostsProvider`, SSH and local hosts), or an allocation of a scheduler that may end,
be replaced and must be released (`slurm/`, the Slurm provider in one package: allocate, state,
job steps, reallocate, release). What is above (dtf.hostops, dtf.program, dtf.collective,
dtf.notebook, `dtf top`) asks its provider; it never asks which engine or scheduler it is.
It may import dtf.errors, dtf.files, dtf.cluster, dtf.hosts and dtf_server.
"""
