"""The user's program under `dtf train`: `train` runs it on this machine as the chief (the
cluster's addresses, the tunnel, the lease, its exit), `runner` is how it is started
(`python -m dtf.program.runner` less the working directory on sys.path: `runner.python_m`),
`hooks` what acts inside it (saving, guards, recovery, packing, --wrap, collective mode's join),
`packer` how many steps go in one closure, `noise` keeps TensorFlow's C++ chatter off its stderr.
The helper API programs use (`import dtf`) is dtf's own __init__ and belongs to this layer. It may
import dtf.errors, dtf.files, dtf.cluster, dtf.hosts, dtf.hostops and dtf_server. What runs inside
the program (runner, hooks, packer, the helper API) also ships to the hosts, in the launcher zipapp
(dtf.files.shipping), for collective mode.
"""
