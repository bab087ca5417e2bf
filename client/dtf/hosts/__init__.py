"""Reaching one host: `base` is the interface every command runner has (`CommandRunner`: commands,
streams, files, a TCP check from the host), `local` runs a `connection: local` host's commands as
this machine's processes, `control` runs them over the host's OpenSSH master (kept for the
cluster's life; `mux` asks the master directly, `masters` starts and closes masters, `openssh`
is the ssh command line), `paramikossh` over paramiko where there is no `ssh`; `connections` is
the one place that picks the engine for a host. `tunnel` carries the laptop's TensorFlow
connections through SSH (network: ssh) with `proxy` (the CONNECT proxy and its routes); `trees`
brings a directory back as a tar; `programs` reads the sh and Python programs of `scripts/` that
commands carry; `knownhosts` keeps dtf's known_hosts for paramiko, `shell` quotes command lines
and `netutil` probes and picks TCP ports. One host at a time, no plan: it may import dtf.errors,
dtf.cluster (HostSpec) and dtf_server.
"""
