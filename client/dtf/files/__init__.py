"""Files: the bytes dtf puts on hosts, made on this machine. `sync` packs a local tree
deterministically and names it by its hash (`dtf sync`, the inventory's `sync:`, collective mode's
program directory); `environment` says what a managed environment holds and keeps the laptop's
wheel cache; `relay` lets one host serve the wheels to the others; `shipping` builds the launcher
zipapp (dtf_server, with this package for the programs run on hosts). The bottom layer with
dtf.errors: it may import only dtf.errors and dtf_server. Sending the bytes is dtf.hostops's.
"""
