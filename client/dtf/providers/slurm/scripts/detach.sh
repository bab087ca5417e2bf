# shellcheck shell=sh
# Start the command (the words given: an `srun` of a job step) on the login host detached from the
# SSH session (setsid -f: a session of its own): the step lives as long as its srun does, and ends
# with the job. Run as `sh -c THIS sh SRUN...` (dtf.providers.slurm.allocation.detach_steps).
setsid -f "$@" >/dev/null 2>&1 </dev/null
