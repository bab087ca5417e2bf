"""The one line `dtf status` and `dtf train` say when a Slurm job no longer runs, from what
`scontrol --oneliner show job` and `show node` print (Slurm 22.05's fields)."""

from __future__ import annotations

from dtf.cluster.inventory import loads
from dtf.providers.slurm.commands import ended_line, fields, salloc_argv

NODES = ("NodeName=h1 Arch=x86_64 State=IDLE ThreadsPerCore=1 Partitions=main\n"
         "NodeName=h2 Arch=x86_64 State=DOWN+NOT_RESPONDING ThreadsPerCore=1 Partitions=main "
         "Reason=Not responding [slurm@2026-11-25T05:52:28] Comment=(null)\n")


def job(state: str, reason: str, limit: str = "UNLIMITED") -> str:
    return (f"JobId=42 JobName=dtf-c UserId=alice(1000) JobState={state} Reason={reason} Dependency=(null) "
            f"Requeue=0 Restarts=0 RunTime=00:01:02 TimeLimit={limit} NodeList=h[1-2]\n")


def test_fields_keep_values_with_spaces() -> None:
    node = fields(NODES.splitlines()[1])
    assert node["State"] == "DOWN+NOT_RESPONDING"
    assert node["Reason"] == "Not responding [slurm@2026-11-25T05:52:28]"
    assert node["Comment"] == "(null)"


def test_a_lost_node_names_the_node_and_its_reason() -> None:
    assert ended_line("42", job("NODE_FAIL", "NodeDown"), NODES) == (
        "slurm job 42 lost a node (NODE_FAIL; NodeDown; node h2 DOWN+NOT_RESPONDING: Not responding "
        "[slurm@2026-11-25T05:52:28]): its tasks ended with it")


def test_a_node_lost_while_slurm_still_runs_the_job() -> None:
    line = ended_line("42", job("RUNNING", "None"), NODES.replace("DOWN+", "MIXED+"))
    assert line.startswith("slurm job 42 lost a node (RUNNING; node h2 MIXED+NOT_RESPONDING: Not responding")
    assert line.endswith("its tasks there are lost (Slurm ends the job when the node times out)")


def test_time_limit_preemption_and_a_forgotten_job() -> None:
    assert ended_line("42", job("TIMEOUT", "TimeLimit", "01:00:00"), "") == (
        "slurm job 42 reached its time limit (TIMEOUT; time limit 01:00:00): its tasks ended with it")
    assert ended_line("42", job("PREEMPTED", "None")) == (
        "slurm job 42 was preempted (PREEMPTED): its tasks ended with it")
    assert ended_line("42", job("CANCELLED", "None")).startswith("slurm job 42 was cancelled (CANCELLED)")
    assert ended_line("42", "") == ("slurm job 42 is no longer in the queue, and Slurm no longer says why "
                                    "(it keeps a finished job for MinJobAge): its tasks ended with it")


def test_dtf_submits_a_job_that_is_never_requeued() -> None:
    # a requeued allocation would hold new nodes without dtf's tasks: it must end instead. Slurm
    # requeues batch jobs only: dtf's is salloc's, with no script.
    inv = loads("cluster: c\nslurm: {login: l, nodes: 2, workers: 1}\n")
    assert salloc_argv(inv)[:2] == ["salloc", "--no-shell"]
