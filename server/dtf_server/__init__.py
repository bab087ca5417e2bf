"""dtf's host side: what runs on each host. Standard library plus TensorFlow only; it never
imports the `dtf` client, so a host needs nothing but a python with TensorFlow.

dtf ships this package to each host as one file, a zipapp named by its content
(`ROOT/launcher-<hash>.pyz`, see `dtf.files.shipping`), and runs `python launcher-<hash>.pyz COMMAND`.

    protocol.py    each command's request (its command line) and reply, typed once for both sides, the
                   protocol version, defaults, where the files live on a host (Layout), and what both sides
                   read the same way (an exit in words, the exit-status file, the TensorFlow version, follow's events)
    procs.py       process and file helpers (which process is ours, ports, logs)
    supervisor.py  one task's supervisor, and the lease
    commands.py    the command line: a command's request read (protocol.parse), the function that runs it
    start.py       check, start, check-start (supervisors forked per task; the firewall rules: firewall.py), serve, fake
    network.py     reach (the mesh check)
    maintenance.py status, top, log, renew, stop, clean
    tflog.py       which lines of a log are TensorFlow's own (`log`, and the laptop's filter of the program's stderr)
    files.py       sync (receive.py), and managed environments' commands (envs.py)
    collective.py  collective mode: run, run-step, supervise-program, follow (program.py)
    envs.py        managed environments: built with uv from sent wheels; wheels from host to host; purge
    tfserve.py     one tf.distribute.Server, started without `import tensorflow` (its C++ server only)
    fake.py        a fake server for tests (no TensorFlow)
"""
