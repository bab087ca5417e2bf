"""A barrier at a point of training, for the fault tests: the program waits there until the
fault is in place.

    python -m dtf.runner barrier.py DIR PATTERN [DIR PATTERN...] -- PROGRAM [ARGS...]

runs PROGRAM ARGS as `python PROGRAM ARGS` would (runpy, as dtf.runner does: the user-facing
examples stay untouched), with one hook: the first time the program prints a line matching the
regular expression PATTERN, the line goes out, then a file DIR/reached-* is written and the
program blocks until DIR/release exists (tests/helpers.py's Barrier: wait for reached, inject
the fault, release). Several DIR PATTERN pairs are several barriers, each holding once (a fault
put in place at one point and taken away at a later one). A relative PROGRAM is found next to this file (collective mode sends the
program's directory to the hosts: copy both there). DIR must be seen by the program and the test
alike (the lab's hosts share this machine's filesystem, except /srv).

It holds only once, and in the run's first attempt: a later attempt (DTF_ATTEMPT > 1, after a
lost ps or copy) and any line after the release run through. A PATTERN written `@N:PATTERN` holds
in attempt N instead. If no release comes within DEADLINE, it says so on stderr
and goes on: a test that failed never leaves a program hanging.
"""

import os
import re
import runpy
import socket
import sys
import time

DEADLINE = 600.0


class HeldStdout:
    """sys.stdout, holding the program at the first complete line that matches each barrier."""

    def __init__(self, stream, barriers):
        self._stream, self._line = stream, ""
        self._barriers = [(where, *_attempt_and(pattern)) for where, pattern in barriers]

    def write(self, text):
        n = self._stream.write(text)
        self._line += text
        while "\n" in self._line:
            line, self._line = self._line.split("\n", 1)
            for where, attempt, pattern in self._barriers:
                if pattern.search(line):
                    self._hold(where, line, attempt)
        return n

    def _hold(self, where, line, attempt):
        release = os.path.join(where, "release")
        if os.environ.get("DTF_ATTEMPT", "1") != attempt or os.path.exists(release):
            return
        self._stream.flush()  # the line is out before the test hears of it
        name = f"reached-{socket.gethostname()}-{os.getpid()}"
        tmp = os.path.join(where, f".{name}")
        with open(tmp, "w") as f:
            f.write(line + "\n")
        os.replace(tmp, os.path.join(where, name))  # whole, or not at all
        deadline = time.monotonic() + DEADLINE
        while not os.path.exists(release):
            if time.monotonic() > deadline:
                print(f"barrier: no release in {where} after {DEADLINE:.0f}s: going on", file=sys.stderr)
                return
            time.sleep(0.05)

    def __getattr__(self, name):
        return getattr(self._stream, name)


def _attempt_and(pattern):
    """The attempt a barrier holds in ("1" unless PATTERN is written @N:...), and its pattern."""
    m = re.match(r"@(\d+):(.*)$", pattern, re.S)
    return (m.group(1), re.compile(m.group(2))) if m else ("1", re.compile(pattern))


def main():
    ours = sys.argv[1:sys.argv.index("--")]
    program, *args = sys.argv[len(ours) + 2:]
    program = os.path.join(os.path.dirname(os.path.abspath(__file__)), program)
    sys.stdout = HeldStdout(sys.stdout, list(zip(ours[::2], ours[1::2])))
    sys.argv = [program, *args]
    sys.path[0] = os.path.dirname(program)
    runpy.run_path(program, run_name="__main__")


if __name__ == "__main__":
    main()
