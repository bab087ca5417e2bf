"""The Slurm provider, in one package: a cluster's hosts are the nodes of a Slurm allocation,
reached through its login host. `commands` (the Slurm commands as argv lists and how their answers
are read: pure), `allocation` (ask for it, wait until it runs, its state, cancel it), `steps` (a
node's runner: every command a job step), `relay` (the tasks' way back to the coordinator in ssh
network mode), `reallocate` (a job that ended replaced by a new allocation), `provider` (the
`Provider` the rest of dtf asks), and `scripts/` (the programs the login host and the first node run).
"""
