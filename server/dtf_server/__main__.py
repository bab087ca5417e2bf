"""`python launcher-<hash>.pyz COMMAND ...`: the launcher's entry point (see commands.py)."""

from __future__ import annotations

import sys

from dtf_server.commands import main

if __name__ == "__main__":
    sys.exit(main())
