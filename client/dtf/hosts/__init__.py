"""Reaching hosts: `transport` runs commands and moves files on one host (SSH through Fabric and
paramiko, or local processes, behind one interface), `control` runs them over one OpenSSH
master per host kept for the cluster's life, `spawn` starts and closes a master's ssh, `openssh` is
the OpenSSH client's command line, `slurmstep` reaches a node of a Slurm allocation (job steps through its login host),
`tunnel` carries the laptop's TensorFlow connections through SSH masters (network: ssh),
`knownhosts` keeps dtf's known_hosts, `shell` quotes command lines and `netutil` probes and picks
TCP ports. One host at a time, no plan: it may import dtf.errors, dtf.cluster (HostSpec) and
dtf_server.
"""
