"""Collective mode (`dtf train --collective`): `run` sends the program and starts one copy per
worker on the hosts, `follow` streams each copy's output and events back, `remote_files` moves
trees to and from hosts (the program's output). The top layer below the command line: it may
import dtf.errors, dtf.files, dtf.cluster, dtf.hosts, dtf.hostops, dtf.program and dtf_server.
"""
