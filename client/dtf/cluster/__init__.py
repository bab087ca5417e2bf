"""The cluster as dtf knows it, before any host is touched: `inventory` parses and checks the
inventory file (HostSpec), `plan` turns it into the pure plan of hosts, tasks and ports, `gpus`
shares a host's GPUs among its workers, and `state` is the typed, versioned local record of the
running clusters and its lock. Pure data and local files only: it may import dtf.errors,
dtf.files (names of synced trees, environments, the launcher's name) and dtf_server, nothing that
talks to a host.
"""
