"""dtf_server.tflog and the launcher's `log` command (`dtf logs`): a task's log without
TensorFlow's own lines, its last N shown lines, and following it."""

from __future__ import annotations

import os
import select
import subprocess
import sys
from pathlib import Path

from dtf_server.tflog import Shown, TaskLog
from helpers import wait_until

SERVER = Path(__file__).resolve().parents[2] / "server"

# A worker's log after a training, as TensorFlow 2.21 wrote it (lines cut short), and after its
# server was killed; gRPC's error details as a worker writes them when a ps goes.
SERVER_LOG = b"""2026-11-29 00:24:54 dtf: worker:0: supervising its server on port 23452 (restart limit 10, backoff 0.5s)
WARNING: All log messages before absl::InitializeLog() is called are written to STDERR
I0000 00:00:1795911895.039643    8128 port.cc:153] oneDNN custom operations are on.
I0000 00:00:1795911895.116560    8128 cpu_feature_guard.cc:227] This TensorFlow binary is optimized to use available CPU instructions in performance-critical operations.
To enable the following instructions: AVX2 AVX512F FMA, in other operations, rebuild TensorFlow with the appropriate compiler flags.
E0000 00:00:1795911895.175718    8128 cuda_platform.cc:52] failed call to cuInit: INTERNAL: CUDA error: Failed call to cuInit: UNKNOWN ERROR (303)
I0000 00:00:1795911895.179875    8128 grpc_server_lib.cc:467] Started server with target: grpc://localhost:23452
dtf: worker:0 serving on port 23452 (lean import)
I0000 00:00:1795911897.489912    8404 eager_service_impl.cc:349] Creating sync eager service context with rendezvous_id on host vm /job:worker/replica:0/task:0
I0000 00:00:1795911897.489975    8404 eager_service_impl.cc:355] SessionOptions: goo.gle/debugstr
device_count {
  key: "CPU"
  value: 1
}
allow_soft_placement: true
experimental {
  collective_group_leader: "/job:worker/replica:0/task:0"
}

W0000 00:00:1795911898.882950    8405 type_inference.cc:340] Type inference failed. Error message: INVALID_ARGUMENT: expected PRODUCT element type for input 0, got goo.gle/debugonly
type_id: TFT_ANY

\twhile inferring type of node 'AutoShardDataset'
I0000 00:00:1795911904.498180    8404 kernel_and_device.cc:101] Ignoring error status when releasing multi-device function handle UNIMPLEMENTED: Releasing a multi-device component handle on a remote device is not yet implemented.
E0000 00:00:1795912027.047556   21781 context.cc:911] Failed to remove function remotely due to failed to connect to all addresses
Additional GRPC error information from remote target /job:ps/replica:0/task:0 while calling /tensorflow.eager.EagerService/Enqueue:
:UNKNOWN:Error received from peer  {grpc_message:"failed to connect to all addresses", grpc_status:14}
This could happen if the remote target has been disconnected from the client.
E1129 00:27:04.123456789   21781 src/core/lib/surface/call.cc:1043] gRPC's own
D1129 00:27:04.123456789   21781 src/core/lib/iomgr/tcp_posix.cc:12] gRPC's debug line (GRPC_VERBOSITY=DEBUG)
2026-11-23 11:27:22.123456: W tensorflow/core/framework/op_kernel.cc:1827] the older format
2026-11-29 00:26:16 dtf: worker:0: server killed by SIGKILL after 82.3s; restart 1 of 10 in 0.5s
"""
KEPT = [
    b"2026-11-29 00:24:54 dtf: worker:0: supervising its server on port 23452 (restart limit 10, backoff 0.5s)\n",
    b"dtf: worker:0 serving on port 23452 (lean import)\n",
    b"2026-11-29 00:26:16 dtf: worker:0: server killed by SIGKILL after 82.3s; restart 1 of 10 in 0.5s\n",
]
# What is never TensorFlow's own, even right after one of its records: a traceback, a FATAL
# record (why a server died), and in collective mode the program's output.
OTHERS = b"""Traceback (most recent call last):
  File "/x/launcher.pyz/dtf_server/tfserve.py", line 91, in serve
tensorflow.python.framework.errors_impl.UnknownError: Could not start gRPC server
I0000 00:00:1795911904.498180    8404 kernel_and_device.cc:101] chatter
F0000 00:00:1795911905.000001    8404 op_kernel.cc:12] Check failed: ok
*** Check failure stack trace: ***
    @     0x7f1dd873de40  (unknown)
I0000 00:00:1795911904.498180    8404 kernel_and_device.cc:101] chatter
Epoch 1/2
I0000 00:00:1795911904.498180    8404 eager_service_impl.cc:355] SessionOptions: goo.gle/debugproto
10/10 - 3s - loss: 0.6012 - accuracy: 0.6531
"""


def kept(data: bytes) -> list[bytes]:
    lines = TaskLog()
    return [line for line in data.splitlines(keepends=True) if lines.keeps(line)]


def test_only_dtfs_lines_are_left_of_a_servers_log() -> None:
    assert kept(SERVER_LOG) == KEPT


def test_a_traceback_a_fatal_record_and_the_programs_output_are_kept() -> None:
    assert b"".join(kept(OTHERS)) == OTHERS.replace(
        b"I0000 00:00:1795911904.498180    8404 kernel_and_device.cc:101] chatter\n", b"").replace(
        b"I0000 00:00:1795911904.498180    8404 eager_service_impl.cc:355] SessionOptions: goo.gle/debugproto\n", b"")


def shown(*chunks: bytes, everything: bool = False) -> bytes:
    s = Shown(everything)
    return b"".join(line for chunk in chunks for line in s.feed(chunk)) + s.partial()


def test_lines_split_across_reads_are_judged_whole() -> None:
    data = SERVER_LOG + OTHERS
    assert shown(*(data[i:i + 7] for i in range(0, len(data), 7))) == shown(data) == b"".join(kept(data))
    assert shown(data, everything=True) == data


def test_a_line_judged_before_its_end_has_its_rest_go_the_same_way() -> None:
    s = Shown()
    assert s.feed(b"dtf: worker:0 serv") == [] and s.partial() == b"dtf: worker:0 serv"
    assert s.feed(b"ing\nI0000 00:00:1.2 ") == [b"ing\n"]
    assert s.partial() == b"I0000 00:00:1.2 "  # not TensorFlow's as far as it goes: shown, and its rest...
    assert s.feed(b" 1 x.cc:1] chatter\n") == [b" 1 x.cc:1] chatter\n"]  # ... with it (absl writes whole lines)
    s = Shown()
    s.feed(b"I0000 00:00:1795911904.498180    8404 x.cc:1] chat")
    assert s.partial() == b""  # ... or not
    assert s.feed(b"ter\ndtf: next\n") == [b"dtf: next\n"]


def launcher(*args: str, **kwargs) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-S", "-m", "dtf_server", "log", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, bufsize=0, env={"PYTHONPATH": str(SERVER), "PATH": os.environ["PATH"]},
                            **kwargs)


def log_of(tmp_path: Path, data: bytes) -> Path:
    task = tmp_path / "worker-0"
    task.mkdir(exist_ok=True)
    (task / "log").write_bytes(data)
    return task / "log"


def test_the_last_n_lines_are_n_shown_lines(tmp_path: Path) -> None:
    log_of(tmp_path, SERVER_LOG + b"\n".join(b"I0000 00:00:1.2 1 x.cc:1] chatter %d" % i for i in range(500)) + b"\n")
    out, err = launcher("--dir", str(tmp_path), "--task", "worker:0", "--lines", "2").communicate(timeout=60)
    assert (out, err) == (b"".join(KEPT[1:]), b"")
    out, _ = launcher("--dir", str(tmp_path), "--task", "worker:0", "--lines", "3", "--all").communicate(timeout=60)
    assert out == b"I0000 00:00:1.2 1 x.cc:1] chatter 497\nI0000 00:00:1.2 1 x.cc:1] chatter 498\n" \
                  b"I0000 00:00:1.2 1 x.cc:1] chatter 499\n"
    log_of(tmp_path, b"dtf: one\ndtf: two, not ended")
    out, _ = launcher("--dir", str(tmp_path), "--task", "worker:0", "--lines", "1").communicate(timeout=60)
    assert out == b"dtf: two, not ended"


def test_a_task_without_a_log_is_one_line(tmp_path: Path) -> None:
    proc = launcher("--dir", str(tmp_path), "--task", "worker:3")
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 1 and out == b""
    assert err.decode() == f"dtf: worker:3 has no log on this host ({tmp_path}/worker-3/log)\n"


def read_line(proc: subprocess.Popen[bytes]) -> bytes:
    """The next line of the followed log (the test fails if none comes)."""
    assert proc.stdout is not None
    wait_until(lambda: select.select([proc.stdout], [], [], 0)[0], timeout=30)
    return proc.stdout.readline()


def test_follow_shows_new_lines_without_tensorflows_and_ends_with_the_task(tmp_path: Path) -> None:
    log = log_of(tmp_path, SERVER_LOG)
    proc = launcher("--dir", str(tmp_path), "--task", "worker:0", "--lines", "1", "--follow")
    try:
        assert read_line(proc) == KEPT[-1]
        with log.open("ab") as f:  # TensorFlow's lines, then one of dtf's: only that one comes
            f.write(b"I0000 00:00:1795911904.498180    8404 x.cc:1] SessionOptions: goo.gle/debugstr\n"
                    b"device_count {\n}\n")
            f.flush()
            f.write(b"dtf: worker:0 still here\n")
        assert read_line(proc) == b"dtf: worker:0 still here\n"
        with log.open("ab") as f:  # a line without its newline shows once it has waited a moment
            f.write(b"dtf: no newline yet")
        assert read_line_or_partial(proc) == b"dtf: no newline yet"
        log.unlink()  # a new log (the cluster started again): followed from its start
        log_of(tmp_path, b"I0000 00:00:1.2 1 x.cc:1] chatter\ndtf: a new log\n")
        assert read_line(proc) == b"dtf: a new log\n"
        for p in tmp_path.glob("worker-0/*"):  # `dtf down`: the task's files go, and the follow ends
            p.unlink()
        (tmp_path / "worker-0").rmdir()
        assert proc.wait(timeout=60) == 0
        assert proc.stderr is not None
        assert proc.stderr.read() == b"dtf: worker:0's log is gone (the cluster was taken down, or its lease lapsed)\n"
    finally:
        proc.kill()
        proc.wait()


def read_line_or_partial(proc: subprocess.Popen[bytes]) -> bytes:
    assert proc.stdout is not None
    wait_until(lambda: select.select([proc.stdout], [], [], 0)[0], timeout=30)
    return os.read(proc.stdout.fileno(), 65536)


def test_follow_ends_when_its_reader_goes(tmp_path: Path) -> None:
    log_of(tmp_path, SERVER_LOG)
    proc = launcher("--dir", str(tmp_path), "--task", "worker:0", "--follow")
    assert proc.stdout is not None
    assert read_line(proc) == KEPT[0]
    proc.stdout.close()  # `dtf logs` gone: nothing new to write, the follow ends all the same
    assert proc.wait(timeout=60) == 0
