"""TensorFlow's own chatter, kept out of the program's stderr under `dtf train` (unless --verbose).

A program under ParameterServerStrategy prints dozens of lines the user can do nothing about: the
C++ runtime's INFO and WARNING lines (absl's `I0000 00:00:... file.cc:12] ...`, written before
anyone calls absl::InitializeLog(), so TF_CPP_MIN_LOG_LEVEL does not reach all of them), one
`Ignoring error status when releasing multi-device function handle` per remote function, the
search for a GPU on a CPU machine, and TensorFlow's warning that its multi-task checkpoint save
function retraces (MultiDeviceSaver traces it anew for every save by design, in eager mode when
the saved variables span several tasks; they always do under this strategy: the model's are on
the ps, the save_counter that tf.train.Checkpoint makes outside any scope is on the coordinator:
nothing dtf or the program does causes it), and the coordinator's "Remote function on worker ...
failed with CancelledError ... This derived error is ignored and not reported to users." (a
closure cancelled because another failed: the error that failed it reaches the program;
tensorflow/python/distribute/coordinator/cluster_coordinator.py). The filter drops those lines,
with the continuation lines TensorFlow attaches to them, and passes everything else through:
the program's output, its errors and tracebacks, TensorFlow's ERROR lines.

The same filter serves output that arrives in whole lines (`keeps`): the program copies of
`dtf train --collective`, whose output (stdout and stderr in one log) dtf prints prefixed per
task and quotes when a copy fails.
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Callable
from typing import IO

from dtf_server import tflog

# A line that starts a noise record: TensorFlow's INFO and WARNING records (dtf_server.tflog's
# patterns, which `dtf logs` applies to a task's log on its host), and the program's own noise.
NOISE = re.compile(rb"|".join([
    tflog.EARLY,
    tflog.absl(b"IW"),  # time: 00:00:EPOCH.US before absl::InitializeLog()
    tflog.dated(b"IW"),
    tflog.absl(b"E") + rb"failed call to cuInit",  # no GPU on a CPU machine: not an error here
    rb"WARNING:tensorflow:\d+ out of the last \d+ calls to <function MultiDeviceSaver\.\w+\.<locals>"
    rb"\.tf_function_(save|restore) ",
    rb".*/tensorflow/python/data/ops/dataset_ops\.py:\d+: UserWarning: To make it possible to "
    rb"preserve tf\.data options across serialization boundaries",
    rb"ERROR:tensorflow:Remote function on worker \S+ failed with CancelledError\(\)",
]))
# Lines that continue the noise record before them.
CONTINUATION = tflog.FOLLOWS
# A partial line (no newline yet) is held back only if it may begin a noise line; anything else
# (a progress bar on stderr) passes at once.
HOLD_FIRST = frozenset(b"IWE0123456789/")
HOLD_FIRST_CONTINUATION = frozenset(b"TA:\t ")  # after a noise line
HOLD_MAX = 8192


class NoiseFilter:
    """Feed it the program's stderr in chunks; it writes what is not noise."""

    def __init__(self, write: Callable[[bytes], None] = lambda _: None) -> None:
        self.write = write
        self.pending = b""
        self.mid_line = False  # the start of the current line was passed through already
        self.dropping = False  # the last line was noise: its continuation lines are too

    def feed(self, data: bytes) -> None:
        *lines, self.pending = (self.pending + data).split(b"\n")
        for line in lines:
            if self.mid_line:
                self.mid_line = False
                self.write(line + b"\n")
            else:
                self._line(line + b"\n")
        if self.pending and not self._may_be_noise(self.pending):
            self.write(self.pending)
            self.pending, self.mid_line, self.dropping = b"", True, False

    def _may_be_noise(self, partial: bytes) -> bool:
        if self.mid_line or b"\r" in partial or len(partial) > HOLD_MAX:
            return False
        return partial[0] in HOLD_FIRST or (self.dropping and partial[0] in HOLD_FIRST_CONTINUATION)

    def close(self) -> None:
        if self.pending and not self.mid_line:
            self._line(self.pending)
        elif self.pending:
            self.write(self.pending)
        self.pending = b""

    def keeps(self, line: str) -> bool:
        """Whether one whole line (without its newline) is not noise, for output that comes in
        lines; the same rules and state as `feed` (a noise line's continuation lines are noise)."""
        return not self._is_noise(line.encode(errors="replace"))

    def _line(self, line: bytes) -> None:
        if not self._is_noise(line):
            self.write(line)

    def _is_noise(self, line: bytes) -> bool:
        if NOISE.match(line) or (self.dropping and CONTINUATION.match(line)):
            self.dropping = True
            return True
        self.dropping = False
        return False


def pump(source: IO[bytes], sink: IO[bytes]) -> threading.Thread:
    """Copy `source` to `sink` through a NoiseFilter, in a thread, until `source` ends."""

    def write(data: bytes) -> None:
        sink.write(data)
        sink.flush()

    def run() -> None:
        noise = NoiseFilter(write)
        fd = source.fileno()
        try:
            while data := os.read(fd, 65536):
                noise.feed(data)
            noise.close()
        except OSError:
            pass  # our own stderr went away: nothing to write to
        finally:
            source.close()

    thread = threading.Thread(target=run, name="dtf-stderr", daemon=True)
    thread.start()
    return thread
