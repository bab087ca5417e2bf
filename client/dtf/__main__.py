"""`python -m dtf`: the `dtf` command (dtf.entry)."""

from dtf.entry import main

main()
