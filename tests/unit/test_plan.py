"""The plan is pure data: indexes, ports, addresses and commands, derived from an inventory."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

from dtf.cluster import inventory
from dtf.cluster.plan import Plan, differences, make_plan
from dtf.files.shipping import launcher_name
from dtf.hosts.shell import expand_local, render
from dtf_server.protocol import TaskSpec

ROOT = Path(__file__).resolve().parents[2]

INV = """\
cluster: demo
defaults: {user: ubuntu, python: /opt/tf/bin/python3, workdir: ~/.dtf}
hosts:
  - {host: gpu-01, ps: 1}
  - {host: gpu-02, workers: 2, tf_port: 3000}
  - {host: gpu-03, address: 192.0.2.7, workers: [4000]}
"""


def plan(text: str = INV, **kw) -> Plan:
    return make_plan(inventory.loads(text, "inv.yaml"), **kw)


def test_tasks_get_indexes_in_inventory_order_ps_first():
    p = plan()
    assert [t.name for t in p.tasks()] == ["ps:0", "worker:0", "worker:1", "worker:2"]
    assert [(t.host, t.port) for t in p.tasks()] == [
        ("gpu-01", 2222), ("gpu-02", 3000), ("gpu-02", 3001), ("gpu-03", 4000)]


def test_cluster_spec_uses_resolved_addresses_in_one_place():
    p = plan(resolve=lambda spec: spec.address or f"{spec.host}.lab")
    assert p.cluster_spec() == {
        "ps": ["gpu-01.lab:2222"],
        "worker": ["gpu-02.lab:3000", "gpu-02.lab:3001", "192.0.2.7:4000"],
    }


def test_commands_are_exact_argv():
    hp = plan().hosts[1]
    launcher = f"~/.dtf/demo/{launcher_name()}"
    assert hp.root == "~/.dtf/demo" and hp.launcher == launcher

    def spec(index: int, port: int) -> str:
        serve = ["/opt/tf/bin/python3", launcher, "serve", "--job", "worker", "--index", str(index),
                 "--port", str(port), "--ready", f"~/.dtf/demo/worker-{index}/ready.json"]
        return json.dumps({"job": "worker", "index": index, "port": port, "argv": serve}, separators=(",", ":"))

    assert hp.start_argv == [
        "/opt/tf/bin/python3", "-S", launcher, "start", "--dir", "~/.dtf/demo",
        "--timeout", "90", "--ttl", "3600", "--restart-limit", "10", "--restart-backoff", "0.5",
        "--env", "GRPC_FAIL_FAST=use_caller", "--env", "PYTHONUNBUFFERED=1",
        "--env", "TF_GRPC_DEFAULT_OPTIONS=grpc.keepalive_time_ms=30000,grpc.keepalive_timeout_ms=20000",
        "--firewall", "auto", "--firewall-port", "3000", "--firewall-port", "3001",
        "--allow", "gpu-01", "--allow", "gpu-02", "--allow", "192.0.2.7", "--allow-client",
        "--task", spec(0, 3000), "--task", spec(1, 3001)]
    assert hp.start_argv_for({"worker:1"})[-2:] == ["--task", spec(1, 3001)]
    assert "--firewall-port" in hp.start_argv_for({"worker:1"})  # a repair's rules cover every port of the host
    assert hp.stop_argv(5) == ["/opt/tf/bin/python3", "-S", launcher, "stop", "--dir",
                               "~/.dtf/demo", "--grace", "5", "--task", "worker:0", "--task", "worker:1"]
    assert hp.tasks[1].log == "~/.dtf/demo/worker-1/log"


def test_plan_round_trips_through_json():
    p = plan()
    assert Plan.from_dict(json.loads(json.dumps(p.to_dict()))) == p
    # to_dict is dataclasses.asdict's dict (without its deep copy), tuples and all.
    for p in (plan(), plan(server="fake"), plan("cluster: g\nhosts:\n  - {host: a, gpus: [0, 1], workers: 2}\n")):
        assert p.to_dict() == dataclasses.asdict(p)
        assert repr(p.to_dict()) == repr(dataclasses.asdict(p))


def test_local_hosts_default_to_this_python_and_loopback():
    p = plan("cluster: l\nhosts:\n  - {host: localhost, connection: local, ps: 1, workers: 1}\n",
             local_python="/venv/bin/python")
    assert p.hosts[0].python == "/venv/bin/python"
    assert p.cluster_spec() == {"ps": ["127.0.0.1:2222"], "worker": ["127.0.0.1:2223"]}


def test_plan_shows_the_serve_command_the_launcher_runs(tmp_path):
    """The serve command shown is the one `start` hands each supervisor, which runs it as is."""
    text = f"cluster: c\nhosts:\n  - {{host: h, workdir: {tmp_path}, python: {sys.executable}, ps: 1, workers: 1}}\n"
    for t in plan(text).tasks():
        hp = plan(text).host_of(t)
        argv = hp.start_argv
        specs = [TaskSpec.from_arg(argv[i + 1]) for i, a in enumerate(argv) if a == "--task"]
        assert next(s.argv for s in specs if s.name == t.name) == list(t.serve_argv)
        assert t.serve_argv[:3] == (sys.executable, hp.launcher, "serve")
        assert t.serve_argv[-2:] == ("--ready", os.path.join(t.dir, "ready.json"))


def test_the_fake_server_and_its_options():
    p = plan(server="fake:ready_delay=1.5,ignore_term")
    argv = p.tasks()[0].serve_argv
    assert argv[2] == "fake" and argv[-3:] == ("1.5", "--ignore-term")[:0] + ("--ready-delay", "1.5", "--ignore-term")
    assert Plan.from_dict(json.loads(json.dumps(p.to_dict()))) == p
    full = plan(server="tensorflow:full").tasks()[0].serve_argv
    assert full[2] == "serve" and full[-1] == "--full"
    for bad in ("tf", "fake:crash", "tensorflow:ready_delay=1", "fake:full", "tensorflow:lean"):
        try:
            plan(server=bad)
        except ValueError:
            continue
        raise AssertionError(bad)


def test_a_record_never_brings_back_another_launcher():
    """The launcher path and serve commands come from this dtf, whatever the record says."""
    data = plan().to_dict()
    for h in data["hosts"]:
        for t in h["tasks"]:
            t["serve_argv"] = ["python3", "~/.dtf/demo/launcher.py", "serve"]
    again = Plan.from_dict(data)
    assert again == plan() and all(launcher_name() in t.serve_argv[1] for t in again.tasks())


def test_render_quotes_every_value_but_a_leading_tilde(tmp_path):
    marker = tmp_path / "pwned"
    hostile = [f"$(touch {marker})", f"`touch {marker}`", f"; touch {marker}", "a b'c\"d", "x\ny"]
    out = subprocess.run(["bash", "-c", render(["printf", "%s|", *hostile])],
                         capture_output=True, text=True, check=True).stdout
    assert out.split("|")[:-1] == hostile
    assert not marker.exists()
    home = subprocess.run(["bash", "-c", render(["echo", "~/a b"])], capture_output=True, text=True).stdout
    assert home.strip() == os.path.expanduser("~/a b")
    assert expand_local(["~/a b", "x~/"]) == [os.path.expanduser("~/a b"), "x~/"]


def test_differences_name_every_change_and_nothing_else():
    assert differences(plan(), plan()) == []
    assert differences(plan(), plan(ttl=60)) == []  # the lease is not the inventory
    changed = INV.replace("workers: 2, tf_port: 3000", "workers: 3, tf_port: 3000, python: python3.11")
    changed = changed.replace("  - {host: gpu-03, address: 192.0.2.7, workers: [4000]}\n",
                              "  - {host: gpu-04, workers: [4000]}\n")
    assert differences(plan(), plan(changed)) == [
        "host gpu-04: added",
        "host gpu-03: removed",
        "host gpu-02: python '/opt/tf/bin/python3' -> 'python3.11'",
        "task worker:2: gpu-03 192.0.2.7:4000 -> gpu-02 gpu-02:3002",
        "task worker:3: added on gpu-04 at gpu-04:4000",
    ]
    fewer = INV.replace("workers: 2, tf_port: 3000", "workers: 1, tf_port: 3000")
    assert differences(plan(), plan(fewer))[-1] == "task worker:2: removed (was on gpu-03 at 192.0.2.7:4000)"


def test_restart_policy_and_lease_reach_the_start_command():
    p = plan(INV.replace("workdir: ~/.dtf}", "workdir: ~/.dtf, restart_limit: 0, restart_backoff: 2.5}"), ttl=0)
    argv = p.hosts[0].start_argv
    assert argv[argv.index("--ttl") + 1] == "0"
    assert argv[argv.index("--restart-limit") + 1] == "0"
    assert argv[argv.index("--restart-backoff") + 1] == "2.5"
    assert p.hosts[0].status_argv()[4:6] == ["--dir", "~/.dtf/demo"] and "--renew" in p.hosts[0].status_argv()


def test_the_plan_keeps_where_the_inventory_names_ssh_config():
    """A record's plan says where its inventory's ssh_config is (checked again at `dtf train
    --collective`); one written before it did says the file's start."""
    p = plan(INV.replace("hosts:\n", "ssh_config: ~/cfg\nhosts:\n"))
    assert (p.ssh_config_line, p.ssh_config_column) == (3, 1)
    again = Plan.from_dict(json.loads(json.dumps(p.to_dict())))
    assert again == p and again.ssh_config_position("/abs/inv.yaml") == inventory.Position("/abs/inv.yaml", 3, 1)
    data = p.to_dict()
    del data["ssh_config_line"], data["ssh_config_column"]
    assert Plan.from_dict(data).ssh_config_position("/abs/inv.yaml") == inventory.Position("/abs/inv.yaml", 1, 1)
    assert (plan().ssh_config_line, plan().ssh_config_column) == (0, 0)


def firewall_of(text: str, host: int = 0, **kw) -> list[str]:
    """The firewall arguments of a host's start (from `--firewall` up to its tasks)."""
    argv = plan(text, **kw).hosts[host].start_argv
    return argv[argv.index("--firewall"):argv.index("--task")] if "--firewall" in argv else []


def test_the_start_closes_the_tf_ports_to_the_cluster_and_the_laptop_unless_told_otherwise():
    """firewall: auto (the default) and members close the host's every TF port to all but the
    cluster's hosts and this machine (its SSH client, as the host sees it) first; this machine only
    where it may reach the tasks directly; a Slurm node's srun host too; off sets nothing."""
    one = "cluster: c\nhosts:\n  - {host: a, ps: 1}\n  - {host: b, address: 192.0.2.9, workers: 2}\n"
    everyone = ["--allow", "a", "--allow", "192.0.2.9"]
    assert firewall_of(one, 1) == ["--firewall", "auto", "--firewall-port", "2222", "--firewall-port", "2223",
                                *everyone, "--allow-client"]
    assert firewall_of("network: direct\nfirewall: members\n" + one) == [
        "--firewall", "members", "--firewall-port", "2222", *everyone, "--allow-client"]
    # Through SSH the laptop needs no way in: members in auto mode reaches the tasks through SSH.
    assert firewall_of("firewall: members\n" + one)[-1] == "192.0.2.9"
    assert firewall_of("network: ssh\n" + one)[-1] == "192.0.2.9"
    assert firewall_of("firewall: off\n" + one) == []
    local = "cluster: c\nhosts:\n  - {host: localhost, connection: local, ps: 1, workers: 1}\n"
    assert firewall_of(local) == ["--firewall", "auto", "--firewall-port", "2222", "--firewall-port", "2223",
                               "--allow", "127.0.0.1"]
    # Read back from the record, the arguments are derived again, the same.
    p = plan(one)
    assert Plan.from_dict(json.loads(json.dumps(p.to_dict()))).hosts[1].firewall == p.hosts[1].firewall
