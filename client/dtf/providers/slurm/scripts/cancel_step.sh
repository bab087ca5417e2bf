# shellcheck shell=sh
# Cancel the steps named "$2" of job "$1" (a stream's job step whose srun was ended: Slurm keeps a
# step whose srun died, dtf.providers.slurm.steps). Run on the login host as `sh -c THIS sh JOB
# NAME`; it never fails.
squeue -h -s --jobs="$1" -o '%i %j' | while read -r step stepname; do
  [ "$stepname" = "$2" ] && scancel "$step"
done
exit 0
