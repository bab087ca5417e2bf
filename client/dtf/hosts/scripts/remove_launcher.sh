# shellcheck shell=sh
# Remove an uploaded launcher "$1" and its cluster directory "$2" if that is then empty, where the
# host's python cannot run the launcher's own `clean` (dtf.hostops.stop.remove_launcher). Run as
# `sh -c THIS sh LAUNCHER DIR`; it never fails.
rm -f "$1"
rmdir "$2" 2>/dev/null
exit 0
