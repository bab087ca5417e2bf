"""`python -m dtf`: the `dtf` command."""

from dtf.cli import main

main()
