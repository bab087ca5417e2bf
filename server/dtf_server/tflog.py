"""TensorFlow's own log lines (its C++ runtime's, gRPC's included), told apart from dtf's and the
program's. One set of patterns for both sides: `dtf logs` leaves those lines out of a task's log
on its host (`Shown`, in the launcher's `log` command: dtf_server.maintenance), and
dtf.program.noise builds its filter of the program's stderr on the laptop from the same patterns.

A record of TensorFlow's log begins with absl's prefix, or with TensorFlow's older one:

    I0000 00:00:1795911895.179875    8128 grpc_server_lib.cc:467] Started server with target: ...
    E1129 00:24:54.123456789    8128 src/core/lib/surface/call.cc:12] (gRPC's own)
    2026-01-31 12:00:00.123456: I tensorflow/core/platform/cpu_feature_guard.cc:182] ...

(absl's: the severity I, W, E or F, and gRPC's D for debug; the month and day, 0000 before absl::InitializeLog() is
called; the time, 00:00:SECONDS since the epoch before that call; the thread; the source file and
line). A record's message may go on over the next lines: a protobuf message printed with
DebugString (protobuf marks that output with a link it draws per process, `goo.gle/debugstr`,
`goo.gle/debugonly` or `goo.gle/debugproto`, so that nobody parses it; TensorFlow logs each new
eager context's SessionOptions so: tensorflow/core/distributed_runtime/eager/
eager_service_impl.cc), gRPC's error details,
an indented note (`\\twhile inferring type of node ...`, `\\t [[{{node SaveV2}}]]`).

In a task's log, what is not TensorFlow's is dtf's (the supervisor's lines, with their time, and
the server's `dtf: ps:0 serving on port ...`), a Python traceback, and in collective mode the
program copy's output. So there a record's continuation is any line after it that is blank,
indented, one of gRPC's known detail lines, or a line of the protobuf message it announced; the
first other line is not TensorFlow's. A FATAL record (F) is kept: it says why a server died.
"""

from __future__ import annotations

import re


def absl(severities: bytes) -> bytes:
    """absl's log prefix, for records of these severities (b"IW")."""
    return rb"[" + severities + rb"]\d{4} \d\d:\d\d:\d+\.\d+ +\d+ [\w./-]+:\d+\] "


def dated(severities: bytes) -> bytes:
    """TensorFlow's older log prefix, for records of these severities."""
    return rb"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+: [" + severities + rb"] "


# absl's word, written once by each process before its first record (its log goes to stderr).
EARLY = rb"WARNING: All log messages before absl::InitializeLog\(\) is called"

# Lines that continue the record before them, whatever else surrounds them (the laptop's filter
# uses only these: there the program's own output may follow a record on the next line).
CONTINUATION = [
    rb"To enable the following instructions: ",  # cpu_feature_guard.cc's second line
    rb"Additional GRPC error information from remote target ",
    rb":UNKNOWN:Error received from peer ",
    rb"This could happen if the remote target has been disconnected from the client\.",
    rb"\t \[\[",
    rb" +warnings\.warn\(",
    rb"This derived error is ignored and not reported to users\.",
]

RECORD = re.compile(rb"|".join([EARLY, absl(b"DIWE"), dated(b"IWE")]))  # D: gRPC's debug lines (GRPC_VERBOSITY)
FOLLOWS = re.compile(rb"|".join(CONTINUATION))
PROTO_MARK = re.compile(rb"goo\.gle/debug\w")
PROTO_LINE = re.compile(rb"[A-Za-z_]\w*(: .*| \{)|\}")  # text format: `field: value`, `message {`, `}`
# Lines that are never TensorFlow's: dtf's (the supervisor's begin with the time), a traceback.
OWN = re.compile(rb"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d )?dtf: |Traceback \(most recent call last\):")


class TaskLog:
    """Which lines of a task's log are not TensorFlow's own, one whole line after another (see the
    module's docstring): a line's verdict depends on the lines before it."""

    def __init__(self) -> None:
        self.within = False  # the last line was TensorFlow's: the next may continue its record
        self.proto = False  # and that record announced a protobuf message

    def keeps(self, line: bytes) -> bool:
        line = line.rstrip(b"\r\n")
        if OWN.match(line):
            self.within = False
            return True
        if RECORD.match(line):
            self.within, self.proto = True, PROTO_MARK.search(line) is not None
            return False
        if self.within and self._continues(line):
            return False
        self.within = False
        return True

    def _continues(self, line: bytes) -> bool:
        return (not line.strip() or line[:1] in (b" ", b"\t") or FOLLOWS.match(line) is not None
                or (self.proto and PROTO_LINE.fullmatch(line) is not None))


class Shown:
    """What is shown of a log that comes in chunks of bytes: every line (`everything`), or those
    a TaskLog keeps. Whole lines are judged as they end; `partial` judges a line that has not
    ended yet (followed output that waits for the rest of its line), and the rest of it then goes
    the same way."""

    def __init__(self, everything: bool = False) -> None:
        self.lines = None if everything else TaskLog()
        self.pending = b""  # the line begun, not ended
        self.rest: bool | None = None  # the current line was judged before it ended: shown or not

    def keeps(self, line: bytes) -> bool:
        return self.lines is None or self.lines.keeps(line)

    def feed(self, data: bytes) -> list[bytes]:
        """The whole lines of what came (with their newline) that are shown."""
        *whole, self.pending = (self.pending + data).split(b"\n")
        shown = []
        for line in whole:
            keep, self.rest = (self.keeps(line) if self.rest is None else self.rest), None
            if keep:
                shown.append(line + b"\n")
        return shown

    def partial(self) -> bytes:
        """The line begun and not ended, as far as it goes, if it is shown ("" else)."""
        if not self.pending:
            return b""
        if self.rest is None:
            self.rest = self.keeps(self.pending)
        data, self.pending = self.pending, b""
        return data if self.rest else b""
