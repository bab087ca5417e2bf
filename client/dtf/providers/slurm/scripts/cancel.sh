# shellcheck shell=sh
# Cancel a Slurm job and wait until the queue no longer lists it: on the login host, one command,
# not a round trip a look. dtf.providers.slurm.commands.cancel_argv runs it as `sh -c THIS sh JOB TRIES
# PAUSE`: scancel, then squeue every PAUSE seconds until it prints nothing for the job (or no
# longer knows it). Exits 3 with squeue's last answer if the job is still listed after TRIES
# looks; scancel's own failure exits 1 with its message.
scancel "$1" || exit 1
n=0
while :; do
  if out=$(squeue --noheader --jobs="$1" --format=%T 2>&1); then
    [ -z "$out" ] && exit 0
  else
    case "$out" in *"Invalid job id"*) exit 0;; esac
  fi
  n=$((n+1))
  [ "$n" -ge "$2" ] && { echo "$out" >&2; exit 3; }
  sleep "$3"
done
