"""Reaching hosts: `base` is the interface every twin has (`Transport`: commands, streams, files,
a TCP check), `transport` its local twin, `control` the OpenSSH twin (every command over one
master per host kept for the cluster's life; `mux` speaks the master's protocol directly),
`paramikossh` the paramiko twin for where there is no `ssh` binary, `slurmstep` a node of a
Slurm allocation (job steps through its login host's transport), `trees` a directory brought back
as a tar. `masters` starts and stops OpenSSH masters (their ssh processes too),
`openssh` is the OpenSSH client's command line.
`tunnel` carries the laptop's TensorFlow connections through SSH masters (network: ssh), with
`proxy` (the CONNECT proxy and its routes) and `loginrelay` (Slurm's way back). `knownhosts`
keeps dtf's known_hosts, `shell` quotes command lines and `netutil` probes and picks TCP ports.
One host at a time, no plan: it may import dtf.errors, dtf.cluster (HostSpec) and dtf_server.
"""
