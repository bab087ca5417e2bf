"""`python launcher-<hash>.pyz COMMAND ...`: the launcher's entry point (see commands.py). The
zipapp's own top-level __main__.py (dtf.files.shipping) calls `launch`."""

from __future__ import annotations

import os
import sys

from dtf_server.commands import main


def launch() -> None:
    """Run the command line's command. python runs a zip's top-level __main__.py with sys.argv[0]
    the zipapp's path, which `start` passes on to the supervisors it starts. A command that did
    its work leaves at once, its replies flushed: the interpreter's own end (its modules torn down
    one by one) is a cost on every launcher command, a host's `up` and each of `status`'s and
    `down`'s. The launcher starts no thread that is not a daemon, and registers no atexit handler.
    An error (an exception, an exit of argparse's) ends as python ends it."""
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
