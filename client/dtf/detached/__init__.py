"""Detached runs (`dtf train --detach`, `dtf attach`): the program's coordinator runs on a host of
the cluster, so the run needs this machine only to start it and to bring its outputs back.

- `start`: `dtf train --detach`: checks the coordinator's host, sends the program's folder and dtf's
  own package there, lets that host into the others with a key made for the run (SSH hosts), and
  starts the coordinator as a supervised task of its host (a job step on Slurm).
- `coordinator`: what runs there (`python -m dtf.detached.coordinator RUN`): dtf train's attempts,
  lease and repair (dtf.program.train), on the cluster as that host sees it (`vantage`).
- `attach`: `dtf attach`: the run's output from a cursor, each line once, then its outputs here.
- `remote`: the run as this machine asks its host: its state, its outputs, the moves it made.

The layer above collective mode, below the command line (the coordinator is the host's command
line: it may import dtf.ui). The host side of it is dtf_server.detached and dtf_server.sshkeys.
"""
