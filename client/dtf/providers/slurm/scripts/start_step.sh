# shellcheck shell=sh
# A node's job step that stays (dtf.providers.slurm.steps: start_servers), started from the login
# host as `sh -c THIS sh LINES TIMEOUT SRUN...`: the srun command (the words after the second) is
# started detached (setsid -f: its own session, it outlives this command), its stdin this command's
# (the launcher's upload), its stderr into a temporary file (holding this session's stderr, it would
# hold the command open for the step's life), and the first LINES lines it writes are passed on, each
# as it comes, for at most TIMEOUT seconds (then exit 124). A step that ends (a failed check, python
# missing) says its exit status last: "dtf-step-exit STATUS". The srun's stderr so far follows on
# this command's stderr.
lines=$1
timeout=$2
shift 2
e=$(mktemp) || exit 1
# shellcheck disable=SC2016
{ setsid -f sh -c '"$@"; echo "dtf-step-exit $?"' sh "$@" 2>"$e"; } |
  timeout "$timeout" sh -c 'n=0; while [ "$n" -lt "$1" ] && IFS= read -r l; do printf "%s\n" "$l"; n=$((n + 1)); done' sh "$lines"
rc=$?
cat "$e" >&2
rm -f "$e"
exit $rc
