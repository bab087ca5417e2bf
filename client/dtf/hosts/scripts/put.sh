# shellcheck shell=sh
# Write stdin to "$1/$2" atomically, as Transport.put_bytes promises: under the temporary name
# "$1/$3" (the directory made first), then renamed over it; a failed write removes the temporary
# and exits 1 with the shell's message. Any words after the third are then run in its place (a
# command after its upload, in one round trip). Run as `sh -c THIS sh DIR FILE TEMPORARY [COMMAND...]`
# (dtf.hosts.control, and a Slurm node's job step: dtf.providers.slurm.steps).
if ! { mkdir -p "$1" && cat > "$1/$3" && mv -f "$1/$3" "$1/$2"; }; then
  rm -f "$1/$3"
  exit 1
fi
shift 3
[ "$#" -eq 0 ] || exec "$@"
