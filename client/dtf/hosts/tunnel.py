"""SSH network mode: the laptop reaches the tasks' TF ports only through SSH.

The hosts keep talking to each other at their cluster addresses; only the laptop's own connections
travel through SSH. `dtf train` starts a `Tunnel`:

- over the cluster's OpenSSH master to each host (dtf.hosts.control: opened by `up` and kept for
  the cluster's life, so a training makes no new SSH handshake; ControlMaster, so that
  ~/.ssh/config, the agent and ProxyJump apply as they do for the user's own `ssh`): `SharedMaster`;
- a remote forward on each master from the host's 127.0.0.1:P back to this machine's P, the
  chief's port, added to the running master for the run (`ssh -O forward`) and cancelled at its
  end: tasks that call the coordinator back (the ps does when a checkpoint is written through it)
  reach it there, even from behind NAT;
- a local HTTP CONNECT proxy, handed to the program as `grpc_proxy` (TensorFlow's gRPC honours
  it). For each CONNECT to a planned task address it starts `ssh -W ADDR:PORT` over that host's
  master with the accepted socket as its stdin and stdout: the bytes are carried by OpenSSH, never
  copied by Python. Any other target is refused. A master that died (a dropped connection) is
  started again at the next CONNECT, which the coordinator makes when it retries.

Each master runs one empty session as soon as it is up, for its TCP_NODELAY (dtf.hosts.masters).
The routes and the proxy: dtf.hosts.proxy. Where there is no `ssh` binary, the same proxy carries
connections over a paramiko channel (`direct-tcpip`), copying in Python: slower, but it works.

On a Slurm cluster the laptop reaches only the login host: the tunnel has that one route, whose
`ssh -W` targets are the compute nodes' task addresses (the login host opens those connections),
and the tasks reach the coordinator back through a relay on the login host (`way_back`:
dtf.providers.slurm.relay; dtf_server.relay: why there, in its doc).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from dtf.cluster.inventory import HostSpec
from dtf.hosts.base import HostError
from dtf.hosts.masters import Master, parallel
from dtf.hosts.netutil import CONNECT_TIMEOUT, listen_port
from dtf.hosts.proxy import Proxy, PythonRoute, Route, SharedMaster


class WayBack(Protocol):
    """The tasks' way back to the coordinator where their host's remote forward is not it (a relay
    on a Slurm login host): opened with the tunnel, closed with it; `address`: where the tasks
    reach the coordinator."""

    address: str

    def open(self) -> str: ...

    def close(self) -> None: ...


WayBackFactory = Callable[[int], WayBack]  # (the chief's port)


class Tunnel:
    """Everything `dtf train` needs in ssh mode: a route per host and the proxy. A context
    manager: on exit the proxy, its channels and the masters are gone."""

    def __init__(self, hosts: Sequence[tuple[HostSpec, Sequence[str]]], ssh_config: str | None,
                 connect_timeout: float = CONNECT_TIMEOUT, way_back: WayBackFactory | None = None,
                 shared: Callable[[HostSpec], Master] | None = None) -> None:
        """`way_back`: where the tasks cannot reach this machine through their own host's remote
        forward (a Slurm allocation's nodes: `hosts` is then its login host alone), what carries
        their connections back to the coordinator into that host's forward, made for the chief's
        port (dtf.providers.slurm.relay).
        `shared`: the cluster's master to a host (dtf.hosts.control), carrying the run's connections
        (SharedMaster); None where there is no `ssh`: paramiko's channels (PythonRoute)."""
        # The chief's port: the tasks reach the coordinator at 127.0.0.1:PORT on their own host, a
        # remote forward of each host's SSH connection back to this machine (a checkpoint written
        # through the coordinator has the ps fetch from it; behind NAT nothing else reaches it).
        self.chief_port = listen_port("127.0.0.1")
        self.routes = []
        for spec, targets in hosts:
            via: SharedMaster | PythonRoute = (SharedMaster(shared(spec), self.chief_port) if shared is not None
                                               else PythonRoute(spec, ssh_config, connect_timeout, self.chief_port))
            self.routes.append(Route(spec.host, via, set(targets)))
        self.proxy = Proxy(self.routes)
        self.relay: WayBack | None = None
        if way_back is not None:
            login = self.routes[0].via
            if not isinstance(login, SharedMaster):
                raise HostError("a Slurm cluster's tasks reach the coordinator through OpenSSH's remote "
                                "forward: install the ssh client (`ssh` on the PATH)")
            self.relay = way_back(self.chief_port)

    @property
    def chief_address(self) -> str:
        """Where the tasks reach the coordinator: 127.0.0.1 on each host (its remote forward), or
        on Slurm the login host's relay."""
        if self.relay is not None:
            return self.relay.address
        return f"127.0.0.1:{self.chief_port}"

    def env(self, direct: Sequence[str] = ()) -> dict[str, str]:
        """The program's environment: its gRPC channels go through the proxy, except to loopback
        and `direct` hosts (names or addresses)."""
        return {"grpc_proxy": self.proxy.url,
                "no_grpc_proxy": ",".join(["localhost", "127.0.0.1", "::1", *direct])}

    def __enter__(self) -> Tunnel:
        try:
            errors = parallel([r.via.ensure for r in self.routes])
            failed = {r.host: str(e) for r, e in zip(self.routes, errors) if e is not None}
            if failed:
                from dtf.errors import HostFailure

                raise HostFailure("dtf train (SSH to the TF ports)", failed)
            if self.relay is not None:
                try:
                    self.relay.open()
                except HostError as e:
                    from dtf.errors import HostFailure

                    raise HostFailure("dtf train (the way back to the coordinator)", {self.routes[0].host: str(e)})
            self.proxy.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.proxy.close()
        if self.relay is not None:
            self.relay.close()
        parallel([r.via.stop for r in self.routes])

