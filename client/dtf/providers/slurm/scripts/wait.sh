# shellcheck shell=sh
# Submit a Slurm job and wait for it, or look at one: one command on the login host per look (a
# round trip each: what the laptop pays per command, not Slurm). dtf.providers.slurm.commands.wait_argv runs
# it as `sh -c "SETTINGS; THIS" sh ARGS`, SETTINGS the shell-quoted assignments of:
#   MS           how long to look, by the login host's clock (a loaded slurmctld makes each
#                squeue slower, not the look longer than that and one squeue)
#   PAUSE        seconds between two squeue
#   ID_MS        how long salloc gets to say its job id (--submit)
#   WATCH_DELAY  seconds between the job running and THEN's start
#   THEN         sh started detached once the job runs (the lease watch's step,
#                slurm.watch_command), its "$job" and "$first" (the job's first node) in its
#                environment; exit 4 if it cannot start
# ARGS: JOB (look at it), or `--submit - - -- SALLOC_ARGV...`: salloc first, left in the
# background (it waits there while the job pends, and exits once it is granted or cancelled), its
# job id read from its first words (within ID_MS; its error, if it ends without one), on the
# answer's first line; a laptop gone before the answer (an interrupted `up`: the answer cannot be
# written) leaves no job: it is cancelled.
# Then squeue every PAUSE seconds, until the job leaves the pending states or MS is up. Answer:
# [JOB ID], the squeue line (empty: squeue no longer lists the job), then for a running job `---`
# and `scontrol --oneliner show node` of its nodes: one line each, in Slurm's order (scontrol walks
# the node list as `scontrol show hostnames` does: one command fewer).
set -e
NL='
'
ms() { t=$(date +%s%N); echo $((t / 1000000)); }
if [ "$1" = --submit ]; then
  shift 4
  said=$(mktemp)
  ( trap '' HUP; exec "$@" ) >"$said" 2>&1 </dev/null &
  salloc=$!
  # Read with the shell's own `read`, the deadline counted in short sleeps (at least ID_MS, later
  # on a loaded host): a look costs a sleep, not a sed and a date each.
  tries=$((ID_MS / 10))
  while :; do
    alive=1
    kill -0 "$salloc" 2>/dev/null || alive=  # (before the read: all it said is in the file then)
    job=
    while IFS= read -r said_line; do
      case $said_line in
        "salloc: Granted job allocation "[0-9]*|"salloc: Pending job allocation "[0-9]*)
          job=${said_line#salloc: * job allocation }; job=${job%%[!0-9]*}; break ;;
      esac
    done <"$said"
    [ -z "$job" ] || break
    tries=$((tries - 1))
    if [ -z "$alive" ] || [ "$tries" -le 0 ]; then
      kill "$salloc" 2>/dev/null || true
      last=$(grep . "$said" | tail -n 1)
      echo "${last:-salloc said no job id}" >&2
      rm -f "$said"
      exit 1
    fi
    sleep 0.01
  done
  rm -f "$said"
  # A `dtf up` interrupted before it read the id (Ctrl-C) closed this session: the job is
  # nobody's then. What this command writes fails once the laptop has gone: cancel it then.
  trap '' PIPE
  submitted=1
  echo "JOB $job" || { scancel "$job"; exit 1; }
else
  job=$1
  shift
fi
end=$(($(ms) + MS))
while :; do
  line=$(squeue --noheader --jobs="$job" --format='%T|%r|%N|%M|%L' 2>&1) || {
    case $line in *"Invalid job id"*) line= ;; *) echo "squeue failed: $line" >&2; exit 1 ;; esac
  }
  case $line in PENDING*|CONFIGURING*|REQUEUED*|RESIZING*) ;; *) break ;; esac
  [ "$(ms)" -lt "$end" ] || break
  sleep "$PAUSE"
done
out=$(
  echo "$line"
  case $line in RUNNING*)
    nodes=${line#*|*|}; nodes=${nodes%%|*}
    shown=$(scontrol --oneliner show node "$nodes")
    first=
    # shellcheck disable=SC2295  # (NL is a newline: no pattern characters to quote)
    case $shown in NodeName=*) first=${shown#NodeName=}; first=${first%%[ $NL]*} ;; esac
    if [ -n "$THEN" ] && [ -n "$first" ]; then
      job=$job first=$first setsid -f sh -c "sleep $WATCH_DELAY; exec $THEN" >/dev/null 2>&1 </dev/null ||
        { echo "cannot start the lease watch" >&2; exit 4; }
    fi
    echo ---
    echo "$shown" ;;
  esac
)
printf '%s\n' "$out" || { [ -z "${submitted:-}" ] || scancel "$job"; exit 1; }
