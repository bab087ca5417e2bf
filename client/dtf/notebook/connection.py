"""`dtf.connect()`: make this Python process (a Jupyter kernel, IPython, `python script.py`) the
coordinator of a cluster that `dtf up` started, with what `dtf train` gives a program.

    import dtf
    cluster = dtf.connect()              # the only cluster up, or dtf.connect("name")
    with cluster.strategy.scope():
        model = ...
    cluster.coordinator.schedule(...)

What connect() sets up, in this process, for as long as the handle is open (`close()`, or the
process's end):
- the environment `dtf train` gives a program (dtf.program.train.program_env: TF_CONFIG with this
  process as chief, tf-keras, gRPC's fail-fast and keepalive, the output directory, the network
  mode), set before the strategy makes its channels;
- in ssh network mode, the tunnel (dtf.hosts.tunnel) whose proxy carries the channels;
- the lease, renewed by a daemon thread (it ends with the process: a dead kernel renews nothing);
- dtf's hooks (dtf.program.hooks: saving on this machine, guards, packing, recovery, figures for
  `dtf top`), installed in-process, and TensorFlow's C++ noise filtered out of fd 2 (in a kernel,
  what reaches fd 2 shows in the cell);
- a watch on the cluster: `dtf down` from a terminal, or a lost ps, ends the coordinator call that
  runs (or the next one) with one clear error (`ClusterGone`), never a hang.

TensorFlow connects a process to one cluster (the eager context, when the strategy is made): the
same cluster again returns the same handle; another one is refused (restart the kernel).

Under `dtf train NOTEBOOK.ipynb` (or `dtf train` of a script that calls connect()) the kernel
already has all that from `dtf train`: connect() then only makes the strategy and the handle.
"""

from __future__ import annotations

import atexit
import contextlib
import html
import os
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dtf.errors import DtfError, ExitCode
from dtf.hosts.netutil import CONNECT_TIMEOUT

if TYPE_CHECKING:
    from dtf.cluster.state import Record
    from dtf.hostops.parallel import HostOps
    from dtf.hostops.status import TaskState

__all__ = ["ClusterGone", "ConnectError", "Connection", "ConnectionLost", "Status", "connect"]

WATCH_EVERY = 1.0  # seconds between two looks at whether `dtf down` began
PS_WAIT = 120.0  # seconds a lost ps gets to serve again before the error says it did not
NETWORK_WAIT = 600.0  # seconds a call that lost the cluster waits for it to answer this machine again


class ConnectError(DtfError):
    """connect() cannot attach (no cluster up, another cluster, a host out of reach): a notebook
    shows it as one `dtf: error: ...` line, no traceback (IPython shows `_render_traceback_`)."""

    def __init__(self, message: str, exit_code: ExitCode = ExitCode.FAILURE) -> None:
        super().__init__(message)
        self.exit_code = exit_code

    def _render_traceback_(self) -> list[str]:
        return [f"dtf: error: {self}"]


class ClusterGone(ConnectError):
    """The cluster went away under a coordinator call (`fit`, `schedule`, `join`): `dtf down` from a
    terminal, or a lost ps. The message says how to go on."""


class ConnectionLost(ConnectError):
    """A coordinator call failed because this machine lost its connection to the cluster (its network
    dropped, it slept), while the cluster stayed intact: the process stays attached, and the cell
    can run again."""


_connection: Connection | None = None
_lock = threading.Lock()


def connect(cluster: str | None = None, *, output: str | os.PathLike[str] | None = None,
            connect_timeout: float = CONNECT_TIMEOUT, verbose: bool = False, packing: bool = True,
            ps_wait: float = PS_WAIT) -> Connection:
    """Attach this process to the cluster `dtf up` started (`cluster`: its name; None: the only one).

    `output`: the output directory (dtf.output_dir(), checkpoints, saved models), as `dtf train
    --output`; `verbose`: keep TensorFlow's INFO and WARNING lines; `packing`: False as `dtf train
    --no-packing`; `ps_wait`: how long a lost ps gets to serve again before the error is raised.
    Called again: the same handle for the same cluster; another cluster is refused.
    """
    global _connection
    with _lock:
        if _connection is not None:
            return _connection.again(cluster)
        try:
            _connection = Connection.open(cluster, output, connect_timeout, verbose, packing, ps_wait)
        except ConnectError:
            raise
        except DtfError as e:
            raise ConnectError("; ".join(e.lines()), e.exit_code) from None
        return _connection


class Connection:
    """This process as the coordinator of a dtf cluster: `dtf.connect()`'s handle. The last line of a
    cell shows it as a table of the cluster's tasks; `with dtf.connect() as cluster:` closes it
    at the block's end."""

    def __init__(self, record: Record, ops: HostOps, managed: bool, ps_wait: float) -> None:
        self.record = record
        self.ops = ops
        self.managed = managed  # under `dtf train`: it keeps the lease and the tunnel, and reruns
        self.ps_wait = ps_wait
        self.stack = contextlib.ExitStack()
        self.closed = False
        self.gone: str | None = None  # why the cluster is gone (`dtf down`), once seen
        self.incarnations: dict[str, tuple[int, int | None]] = {}
        self.calls = 0  # coordinator calls in progress (on the main thread)
        self.main_thread = threading.main_thread()
        self.stopping = threading.Event()
        self.seconds = 0.0  # how long connect() took
        self._strategy: Any = None
        self._watcher: threading.Thread | None = None

    @property
    def cluster(self) -> str:
        return self.record.cluster

    # -- opening -----------------------------------------------------------------------------
    @classmethod
    def open(cls, cluster: str | None, output: str | os.PathLike[str] | None, connect_timeout: float,
             verbose: bool, packing: bool, ps_wait: float) -> Connection:
        from dtf.hostops import lifecycle
        from dtf.hostops.parallel import HostOps
        from dtf.program import train
        from dtf.program.hooks import packing as packing_hook

        t0 = time.monotonic()
        managed = bool(os.environ.get("DTF_CLUSTER")) and bool(os.environ.get("TF_CONFIG"))
        if managed:  # under `dtf train`: the environment, lease, tunnel and hooks are there already
            name = os.environ["DTF_CLUSTER"]
            if cluster is not None and cluster != name:
                raise ConnectError(f"this program runs under `dtf train` on cluster {name!r}: it cannot "
                                   f"connect to {cluster!r} (call dtf.connect() with no name)")
            record = lifecycle.recorded(name)
            self = cls(record, HostOps(record.plan, connect_timeout=connect_timeout), True, ps_wait)
        else:
            check_keras_order()
            record = lifecycle.recorded(cluster)
            self = cls(record, train.serving(record, connect_timeout), False, ps_wait)
            try:
                tunnel = train.attach(self.stack, record, connect_timeout)
                self.stack.enter_context(train.RunFigures(record.cluster, 1))  # for `dtf top`, as `dtf train`
                self.stack.callback(_stop_figures)  # first: its last write before RunFigures removes them
                hook_env = {packing_hook.ENV: "auto" if packing else "off"}
                os.environ.update(train.program_env(
                    record.plan, record.chief_host, str(output) if output is not None else None, 1, tunnel,
                    synced={n: s.task_path for n, s in record.synced.items()}, hook_env=hook_env))
                from dtf.program import tfkeras

                tfkeras.use_tf_keras()  # TF_USE_LEGACY_KERAS=1 now: what TensorFlow's import decided, as with it
                from dtf.notebook import kernel

                kernel.setup(quiet=not verbose)
                self.incarnations = train.ps_incarnations(self.ops)
                self._strategy = _make_strategy()
                self.watch()
                atexit.register(self.close)  # a process that ends attached: its tunnel and figures go
            except BaseException:
                self.stack.close()
                raise
        if self._strategy is None:
            self._strategy = _make_strategy()
        self.seconds = time.monotonic() - t0
        return self

    def again(self, cluster: str | None) -> Connection:
        """connect() called again in this process."""
        if cluster is not None and cluster != self.cluster:
            raise ConnectError(f"this process is connected to cluster {self.cluster!r}; TensorFlow connects a "
                               f"process to one cluster: restart the kernel (or the program) to connect to "
                               f"{cluster!r}")
        if self.closed:
            raise ConnectError(f"the connection to cluster {self.cluster!r} was closed; TensorFlow cannot "
                               f"attach this process again: restart the kernel to connect")
        return self

    # -- the handle ---------------------------------------------------------------------------
    @property
    def strategy(self) -> Any:
        """The ParameterServerStrategy of the cluster (dtf.strategy())."""
        self._usable()
        return self._strategy

    @property
    def coordinator(self) -> Any:
        """Its ClusterCoordinator (dtf.coordinator())."""
        import dtf

        self._usable()
        return dtf.coordinator()

    def status(self) -> Status:
        """Every task's state, as its host reports it now: a list of TaskState that shows as
        `dtf status`'s table (in a notebook, an HTML table)."""
        from dtf.hostops.status import states

        return Status(self.cluster, states(self.ops))

    def logs(self, task: str, n: int = 50) -> str:
        """The last `n` lines of a task's log (as `dtf logs TASK -n N`)."""
        from dtf.errors import HostFailure
        from dtf.hosts.base import HostError

        plan = self.record.plan
        t = plan.task(task)
        if t is None:
            raise ConnectError(f"cluster {self.cluster!r} has no task {task!r} "
                               f"(tasks: {', '.join(x.name for x in plan.tasks())})")
        hp = plan.host_of(t)
        try:
            with self.ops.runner(hp) as conn:
                result = conn.run(["tail", "-n", str(int(n)), t.log], timeout=30)
        except HostError as e:
            raise ConnectError(str(HostFailure("logs", {hp.name: str(e)}))) from None
        return str(result.stdout)

    def close(self) -> None:
        """Stop renewing the lease and close the tunnel; the cluster stays up (`dtf down` stops it).
        This process cannot attach again: restart the kernel to connect."""
        if self.closed:
            return
        self.closed = True
        self.stopping.set()
        self.stack.close()
        if self._watcher is not None and self._watcher is not threading.current_thread():
            self._watcher.join(timeout=10)

    def __enter__(self) -> Connection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _usable(self) -> None:
        if self.gone is not None:
            raise ClusterGone(self.gone)
        if self.closed:
            raise ConnectError(f"the connection to cluster {self.cluster!r} was closed: restart the kernel "
                               f"to connect again")

    # -- what a notebook shows -----------------------------------------------------------------
    def _rows(self) -> list[tuple[str, str, str, str]]:
        try:
            return [(s.task.name, s.task.host, s.task.address, s.state + (f" ({s.reason})" if s.reason else ""))
                    for s in self.status()]
        except DtfError as e:
            return [(t.name, t.host, t.address, f"unknown ({e})") for t in self.record.plan.tasks()]

    def _title(self) -> str:
        state = "closed" if self.closed else "gone: " + self.gone if self.gone else "attached"
        return f"dtf cluster {self.cluster!r} ({self.record.network} network, {state})"

    def __repr__(self) -> str:
        rows = [("task", "host", "address", "state"), *self._rows()]
        widths = [max(len(r[i]) for r in rows) for i in range(4)]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
        return "\n".join([self._title(), *("  " + line for line in lines)])

    def _repr_html_(self) -> str:
        head = "".join(f"<th>{h}</th>" for h in ("task", "host", "address", "state"))
        body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>" for r in self._rows())
        return (f"<div><b>{html.escape(self._title())}</b><table><thead><tr>{head}</tr></thead>"
                f"<tbody>{body}</tbody></table></div>")

    # -- the watch ------------------------------------------------------------------------------
    def watch(self) -> None:
        """Coordinator calls go through `guarded`; a thread looks for `dtf down` and interrupts a
        call that waits when it begins."""
        from dtf.notebook import calls

        calls.install(self)
        self._watcher = threading.Thread(target=self._watch, name="dtf-watch", daemon=True)
        self._watcher.start()

    def _watch(self) -> None:
        from dtf.program.train import interrupt_main_thread, taken_down

        while not self.stopping.wait(WATCH_EVERY):
            if not taken_down(self.record):
                continue
            # A call's error may have found it first (`explain` then set `gone`): the lease and the
            # tunnel go all the same, and only a call that still waits is interrupted.
            found = self.gone is None
            if found:
                self.gone = down_message(self.cluster)
            self.stopping.set()
            self.stack.close()  # the lease and the tunnel: the cluster is going
            if found and self.calls > 0:
                interrupt_main_thread(os.getpid())

    def explain(self, error: BaseException) -> ConnectError | None:
        """A coordinator call failed with `error`: the one clear error to raise instead, if the
        cluster went away (`dtf down`), a ps was lost, or this machine lost its connection to the
        cluster (waited for, up to NETWORK_WAIT seconds, before anything is asked of the hosts);
        None if it is the program's own."""
        from dtf.hostops import reach
        from dtf.program.runner import connection_error, error_line
        from dtf.program.train import lost_ps, taken_down, wait_serving

        if self.gone is None and taken_down(self.record):
            self.gone = down_message(self.cluster)
        if self.gone is not None:
            return ClusterGone(self.gone)
        if isinstance(error, KeyboardInterrupt):
            return None
        network = self.record.network
        tasks = self.record.plan.tasks()
        waited: float | None = None
        try:
            if len(reach.unreachable(self.ops, network, reach.PROBE_TIMEOUT)) == len(tasks):
                t0 = time.monotonic()
                still = wait_serving(self.ops, network, NETWORK_WAIT)
                if still:
                    return ConnectionLost(
                        f"cluster {self.cluster!r}: no task answered this machine for {NETWORK_WAIT:g}s (its "
                        f"network?): run the cell again once it is back; this kernel is still attached")
                waited = time.monotonic() - t0
            lost = lost_ps(self.ops, self.incarnations, network)
        except DtfError:
            return None
        if not lost:
            if waited is None and not connection_error(error):
                return None
            why = f"no task answered this machine for {waited:.0f}s" if waited is not None else error_line(error)
            return ConnectionLost(
                f"cluster {self.cluster!r}: this cell lost its connection to the cluster ({why}); the cluster is "
                f"intact and this kernel still attached, but TensorFlow may have dropped the variables it made "
                f"there when it reconnected: run the cells that build the model again, then this one (a fit with "
                f"dtf.BackupAndRestore() resumes from its last backup)")
        still = wait_serving(self.ops, self.record.network, self.ps_wait)
        import dtf

        self.gone = lost_ps_message(self.cluster, lost, still, dtf.checkpoint_dir().resolve())
        return ClusterGone(self.gone)


class Status(list["TaskState"]):
    """`cluster.status()`: every task's state (TaskState, ps first), shown as `dtf status` shows it.
    A list, so that a program reads it as one; its repr and `_repr_html_` (what a notebook shows)
    are the table."""

    HEADERS = ("task", "host", "address", "pid", "state", "uptime", "restarts", "last exit")

    def __init__(self, cluster: str, states: list[TaskState]) -> None:
        super().__init__(states)
        self.cluster = cluster

    def rows(self) -> list[tuple[str, ...]]:
        """One row per task, the columns of HEADERS (pid: the server's, as in `dtf status`)."""
        out: list[tuple[str, ...]] = []
        for st in self:
            info = st.status
            state = st.state + (f" ({st.reason})" if st.reason and st.state != "alive" else "")
            out.append((st.task.name, st.task.host, st.task.address,
                        str(info.server_pid) if info and info.server_pid else "-", state,
                        f"{info.uptime:.0f}s" if info and info.uptime is not None else "-",
                        str(info.restarts if info else 0), (info.last_exit if info else None) or "-"))
        return out

    def title(self) -> str:
        alive = sum(st.state == "alive" for st in self)
        return f"cluster {self.cluster!r}: {alive} of {len(self)} tasks alive"

    def __repr__(self) -> str:
        rows: list[tuple[str, ...]] = [self.HEADERS, *self.rows()]
        widths = [max(len(r[i]) for r in rows) for i in range(len(self.HEADERS))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
        return "\n".join([self.title(), *("  " + line for line in lines)])

    def _repr_html_(self) -> str:
        head = "".join(f"<th>{h}</th>" for h in self.HEADERS)
        body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>" for r in self.rows())
        return (f"<div><b>{html.escape(self.title())}</b><table><thead><tr>{head}</tr></thead>"
                f"<tbody>{body}</tbody></table></div>")


def down_message(cluster: str) -> str:
    return (f"cluster {cluster!r} was taken down (`dtf down`) while this process was attached: `dtf up` "
            f"again, then restart the kernel and connect")


def lost_ps_message(cluster: str, lost: list[str], still: list[str], checkpoints: Path) -> str:
    """One line for a ps lost under a coordinator call: what happened, whether the servers are
    back, how to continue."""
    back = ("the servers are serving again" if not still else
            f"still not serving: {', '.join(still)} (see `dtf status`)")
    return (f"cluster {cluster!r}: {', '.join(lost)} lost, and with it the variables it held; {back}. "
            f"This kernel cannot go on training: restart the kernel and run the notebook again, resuming "
            f"from the last checkpoint in {checkpoints} (dtf.checkpoint_dir())")


def check_keras_order() -> None:
    """connect() where tf.keras is already Keras 3 (used before dtf was imported): refused, it has
    no ParameterServerStrategy. TensorFlow imported first is fine as long as nothing used tf.keras:
    tf.keras then becomes tf-keras (dtf.program.tfkeras)."""
    from dtf.program import tfkeras

    refused = tfkeras.refusal()
    if refused is not None:
        raise ConnectError(refused)


def _make_strategy() -> Any:
    import dtf

    return dtf.strategy()


def _stop_figures() -> None:
    """The training figures' publisher (dtf.program.figures) of this process, stopped: the
    connection is closed, `dtf top` shows no program on the cluster."""
    from dtf.program import figures

    os.environ[figures.ENV] = "off"
    if figures._current is not None:
        figures._current.stop()
        figures._current = None
