"""The CLI's contract: fast help, one-line errors with the right exit codes, no tracebacks."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dtf.cli import app
from dtf.cluster import state
from dtf.cluster.inventory import load
from dtf.cluster.plan import Plan
from dtf.errors import InventoryError
from dtf.files.shipping import launcher_name
from dtf.hosts.connections import check_ssh_config

runner = CliRunner()


@pytest.fixture(autouse=True)
def dtf_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("DTF_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def test_help_does_not_import_tensorflow():
    code = "import sys; from dtf.cli import app; print('tensorflow' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
    r = subprocess.run([sys.executable, "-m", "dtf.cli", "--help"], capture_output=True, text=True)
    assert r.returncode == 0 and "up" in r.stdout and "train" in r.stdout


def test_dry_run_prints_the_plan_and_touches_nothing(tmp_path: Path, dtf_home: Path):
    inv = tmp_path / "inv.yaml"
    inv.write_text("cluster: demo\ndefaults: {python: /opt/tf/bin/python3}\n"
                   "hosts:\n  - {host: gpu-01, ps: 1}\n  - {host: gpu-02, workers: 2}\n")
    r = runner.invoke(app, ["up", "--dry-run", str(inv)])
    assert r.exit_code == 0, r.output
    assert "host gpu-02 (ssh gpu-02)" in r.output
    launcher = f"~/.dtf/demo/{launcher_name()}"

    def task(index: int, port: int) -> str:
        return (f"""--task '{{"job":"worker","index":{index},"port":{port},"argv":["/opt/tf/bin/python3","{launcher}","""
                f""""serve","--job","worker","--index","{index}","--port","{port}","--ready","""
                f""""~/.dtf/demo/worker-{index}/ready.json"]}}'""")

    assert (f"start    /opt/tf/bin/python3 -S {launcher} start --dir ~/.dtf/demo --timeout 90 "
            "--ttl 3600 --restart-limit 10 --restart-backoff 0.5 --env GRPC_FAIL_FAST=use_caller --env PYTHONUNBUFFERED=1 "
            "--env TF_GRPC_DEFAULT_OPTIONS=grpc.keepalive_time_ms=30000,grpc.keepalive_timeout_ms=20000 "
            "--firewall auto --firewall-port 2222 --firewall-port 2223 --allow gpu-01 --allow gpu-02 --allow-client "
            f"{task(0, 2222)} {task(1, 2223)}\n") in r.output
    assert ("firewall: auto: on each host, before its servers start, the TF ports accept connections only "
            "from gpu-01, gpu-02, loopback and this machine's address as the host sees it (needs root or "
            "passwordless sudo for nft or iptables there, else `up` goes on and says so)\n") in r.output
    assert (f"worker:1   gpu-02:2223              GRPC_FAIL_FAST=use_caller PYTHONUNBUFFERED=1 "
            "TF_GRPC_DEFAULT_OPTIONS=grpc.keepalive_time_ms=30000,grpc.keepalive_timeout_ms=20000 /opt/tf/bin/python3 "
            f"{launcher} serve --job worker --index 1 --port 2223 --ready ~/.dtf/demo/worker-1/ready.json\n") in r.output
    assert '"worker": ["gpu-02:2222", "gpu-02:2223"]' in r.output
    assert not dtf_home.exists()


def test_bad_inventory_is_one_line_per_mistake_exit_3(tmp_path: Path):
    inv = tmp_path / "inventory.yaml"
    inv.write_text("cluster: demo\nhosts:\n  - {host: a, ps: 1}\n  - host: b\n    workers: two\n")
    r = runner.invoke(app, ["up", str(inv)])
    assert r.exit_code == 3
    assert r.output.strip().splitlines() == [
        f"dtf: error: {inv}:5:5: hosts[1].workers: expected a whole number >= 0 or a list of ports, got 'two'"]
    assert r.exception is None or isinstance(r.exception, SystemExit)


def test_missing_inventory_file(tmp_path: Path):
    r = runner.invoke(app, ["up", str(tmp_path / "nope.yaml")])
    assert r.exit_code == 3 and "nope.yaml:1:1: cannot read file" in r.output


# The program exists (this file): with no cluster, that is the error, whatever the command.
@pytest.mark.parametrize("argv", [["train", __file__], ["status"], ["logs", "ps:0"]])
def test_no_cluster_says_run_up_first(argv: list[str]):
    r = runner.invoke(app, argv)
    assert r.exit_code == 5
    assert r.output.strip() == "dtf: error: no cluster is up: run `dtf up INVENTORY` first"


# A down of nothing succeeds (as `docker compose down` does): one line, exit 0.
@pytest.mark.parametrize(("argv", "line"), [
    (["down"], "no cluster is up: nothing to take down"),
    (["down", "-c", "other"], "no cluster named 'other' is up: nothing to take down"),
])
def test_down_of_nothing_succeeds(argv: list[str], line: str):
    r = runner.invoke(app, argv)
    assert r.exit_code == 0
    assert r.output.strip() == line


def empty_record(name: str) -> state.Record:
    return state.Record(plan=Plan(cluster=name, inventory="i", ssh_config=None, hosts=()),
                        inventory="i", created=0.0, chief_host="127.0.0.1")


def test_unknown_cluster_and_task_names(dtf_home: Path):
    state.save(empty_record("c1"))
    r = runner.invoke(app, ["status", "-c", "other"])
    assert r.exit_code == 5 and "no cluster named 'other' is up (recorded: c1)" in r.output
    # A task the cluster does not have is a mistake on the command line (exit 2).
    r = runner.invoke(app, ["logs", "worker:9"])
    assert r.exit_code == 2 and "cluster 'c1' has no task 'worker:9'" in r.output
    state.save(empty_record("c2"))
    r = runner.invoke(app, ["down"])
    assert r.exit_code == 5 and "several clusters are up (c1, c2): pass --cluster NAME" in r.output


def test_state_lock_makes_a_second_command_fail_clearly(dtf_home: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(state, "LOCK_WAIT", 0.3)
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with state.locked():
            held.set()
            release.wait(10)

    t = threading.Thread(target=hold)
    t.start()
    held.wait(5)
    try:
        with pytest.raises(state.StateBusy, match="another dtf command is running"), state.locked(wait=0.3):
            pass
    finally:
        release.set()
        t.join()


def test_damaged_record_is_a_clear_error(dtf_home: Path):
    (dtf_home / "state").mkdir(parents=True)
    (dtf_home / "state" / "c.json").write_text("{not json")
    r = runner.invoke(app, ["status"])
    assert r.exit_code == 5 and "the record of cluster 'c' is damaged" in r.output


def test_train_missing_program(dtf_home: Path):
    # A usage error (exit 2), with a cluster up or not: not "no cluster" nor a program failure.
    r = runner.invoke(app, ["train", "no_such_program.py"])
    assert r.exit_code == 2 and "program not found: no_such_program.py" in r.output
    state.save(empty_record("c"))
    r = runner.invoke(app, ["train", "no_such_program.py"])
    assert r.exit_code == 2 and "program not found: no_such_program.py" in r.output


def test_record_of_another_dtf_is_one_line(dtf_home: Path):
    (dtf_home / "state").mkdir(parents=True)
    # A record as dtf wrote it before records had a version.
    (dtf_home / "state" / "old.json").write_text(json.dumps(
        {"cluster": "old", "inventory": "i", "created": 0, "chief_host": "h", "pids": {},
         "plan": {"cluster": "old", "inventory": "i", "ssh_config": None, "hosts": []}}))
    for argv in (["status"], ["down"], ["logs", "ps:0"]):
        r = runner.invoke(app, argv)
        assert r.exit_code == 5, r.output
        assert r.output.splitlines() == [
            f"dtf: error: the record of cluster 'old' ({dtf_home}/state/old.json) was written by another "
            "version of dtf (record format 1, this dtf reads 3): take the cluster down with the dtf that "
            "started it, or stop its tasks by hand and remove the record"], r.output


def test_record_round_trip(dtf_home: Path):
    from dtf.cluster import inventory
    from dtf.cluster.plan import make_plan

    plan = make_plan(inventory.loads("cluster: rt\nhosts:\n  - {host: a, ps: 1, workers: 2}\n", "i.yaml"))
    record = state.Record(plan=plan, inventory="/x/i.yaml", created=12.5, chief_host="10.0.0.1",
                          pids={"ps:0": 11, "worker:0": 12, "worker:1": 13})
    state.save(record)
    assert state.load("rt") == record
    assert json.loads(state.path_of("rt").read_text())["version"] == state.RECORD_VERSION


def test_version():
    r = runner.invoke(app, ["--version"])
    assert r.exit_code == 0 and r.output.startswith("dtf ")


@pytest.mark.parametrize("text, seconds", [("90", 90), ("90s", 90), ("1.5m", 90), ("2h", 7200),
                                           ("1d", 86400), ("0", 0), ("never", 0), (" 30M ", 1800)])
def test_durations(text: str, seconds: float):
    from dtf.cli import parse_duration

    assert parse_duration(text, "--ttl") == seconds


@pytest.mark.parametrize("bad", ["", "-5s", "5 minutes", "1e3", "h", "5x"])
def test_bad_ttl_is_a_usage_error(tmp_path: Path, bad: str):
    inv = tmp_path / "inv.yaml"
    inv.write_text("cluster: demo\nhosts:\n  - {host: a, ps: 1, workers: 1}\n")
    r = runner.invoke(app, ["up", "--ttl", bad, "--dry-run", str(inv)])
    assert r.exit_code == 2
    assert r.output.strip().splitlines() == [
        f"dtf: error: --ttl: expected a duration like 90s, 30m, 2h or 0 (never), got {bad!r}"]


def test_missing_or_broken_ssh_config_is_an_inventory_error(tmp_path: Path):
    inv = tmp_path / "inv.yaml"
    inv.write_text(f"cluster: demo\nssh_config: {tmp_path}/nope\nhosts:\n  - {{host: a, ps: 1, workers: 1}}\n")
    r = runner.invoke(app, ["up", "--dry-run", str(inv)])
    assert r.exit_code == 3
    assert r.output.splitlines() == [f"dtf: error: {inv}:2:1: ssh_config: {tmp_path}/nope: No such file or directory"]
    (tmp_path / "nope").write_text("Host a\n  ProxyCommand\n")
    r = runner.invoke(app, ["up", "--dry-run", str(inv)])
    assert r.exit_code == 3 and "ssh_config: " in r.output and "cannot parse it" in r.output


def test_a_slurm_inventorys_ssh_config_is_checked_by_openssh_alone(tmp_path: Path):
    """A Slurm inventory's nodes take their addresses from Slurm: only OpenSSH reads its
    ssh_config (`ssh -G`), and `up` does not import paramiko (a slow import) to check the file."""
    if shutil.which("ssh") is None:
        if os.environ.get("CI") == "true":
            pytest.fail("no ssh (CI=true: `apt-get install openssh-client`: .ci/run does it)")
        pytest.skip("needs OpenSSH's ssh")
    inv = tmp_path / "inv.yaml"
    inv.write_text("cluster: demo\nssh_config: cfg\nslurm: {login: login, nodes: 2, workers: 1}\n")
    config = tmp_path / "cfg"
    config.write_text("Host login\n  HostName 10.0.0.1\n")
    code = (f"import sys; from pathlib import Path; from dtf.hosts.connections import check_ssh_config\n"
            f"from dtf.cluster.inventory import load\n"
            f"check_ssh_config(load(Path({str(inv)!r})).position('ssh_config'), {str(config)!r})\n"
            f"assert 'paramiko' not in sys.modules, 'paramiko imported'\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    config.write_text("Host login\n  Bogus yes\n")
    with pytest.raises(InventoryError) as e:
        check_ssh_config(load(inv).position("ssh_config"), str(config))
    assert str(e.value) == f"{inv}:2:1: ssh_config: {config}: cannot parse it: line 2: Bad configuration option: bogus"


def test_an_ssh_inventorys_addresses_are_openssh_s_and_up_does_not_import_paramiko(tmp_path: Path):
    """Where there is an `ssh`, the hosts' TF addresses are the HostName OpenSSH connects to (`ssh
    -G`, every host at once), and each master's look for jump hosts reuses what it said: `up`
    does not import paramiko (a slow import at every `up`'s start)."""
    if shutil.which("ssh") is None:
        if os.environ.get("CI") == "true":
            pytest.fail("no ssh (CI=true: `apt-get install openssh-client`: .ci/run does it)")
        pytest.skip("needs OpenSSH's ssh")
    inv = tmp_path / "inv.yaml"
    inv.write_text("cluster: demo\nssh_config: cfg\nhosts:\n  - {host: a, ps: 1}\n  - {host: b, workers: 1}\n"
                   "  - {host: c, address: 10.0.0.9, workers: 1}\n")
    (tmp_path / "cfg").write_text("Host a\n  HostName 10.0.0.1\nHost b\n  HostName 10.0.0.2\n  ProxyJump hop\n")
    code = textwrap.dedent(f"""
        import subprocess, sys
        from pathlib import Path
        from dtf.cluster.inventory import load
        from dtf.hostops.lifecycle import load_plan
        from dtf.hosts.masters import Master
        from dtf.hosts.openssh import ssh_binary
        plan = load_plan(load(Path({str(inv)!r})))
        print(" ".join(t.address for t in plan.tasks()))
        assert "paramiko" not in sys.modules, "paramiko imported"
        runs = []
        popen = subprocess.Popen.__init__
        def counted(self, argv, *a, **k):
            runs.append(argv)
            popen(self, argv, *a, **k)
        subprocess.Popen.__init__ = counted
        jumps = [[j.host for j in Master(ssh_binary(), hp.spec, plan.ssh_config, "/nonexistent").jumps()]
                 for hp in plan.hosts[:2]]
        print(jumps, runs)
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == ["10.0.0.1:2222 10.0.0.2:2222 10.0.0.9:2222", "[[], ['hop']] []"]


def test_up_reads_its_hosts_ssh_settings_once(tmp_path: Path):
    """The plan reads its hosts' `ssh -G` side by side: one `ssh -G` per host in all."""
    if shutil.which("ssh") is None:
        if os.environ.get("CI") == "true":
            pytest.fail("no ssh (CI=true: `apt-get install openssh-client`: .ci/run does it)")
        pytest.skip("needs OpenSSH's ssh")
    inv = tmp_path / "inv.yaml"
    inv.write_text("cluster: demo\nssh_config: cfg\nhosts:\n" + "".join(
        f"  - {{host: h{i}, workers: 1}}\n" for i in range(12)) + "  - {host: x, address: 10.0.0.9, ps: 1}\n")
    (tmp_path / "cfg").write_text("".join(f"Host h{i}\n  HostName 10.0.1.{i}\n" for i in range(12)))
    code = textwrap.dedent(f"""
        import subprocess, sys
        from pathlib import Path
        runs = []
        popen = subprocess.Popen.__init__
        def counted(self, argv, *a, **k):
            if "-G" in argv and argv[-1] != "dtf-ssh-config-check":  # (that one checks the file itself)
                runs.append(argv[-1])
            popen(self, argv, *a, **k)
        subprocess.Popen.__init__ = counted
        from dtf.cluster.inventory import load
        from dtf.hostops.lifecycle import load_plan
        plan = load_plan(load(Path({str(inv)!r})))
        print(" ".join(t.address for t in plan.tasks()))
        print(sorted(runs))
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == "10.0.0.9:2222 " + " ".join(f"10.0.1.{i}:2222" for i in range(12))
    assert lines[1] == str(sorted(f"h{i}" for i in range(12)))


def test_ci_asks_the_lab_for_network_namespaces_only():
    """Under CI a lab that could only fall back to loopback fails the run (its netns-only tests
    would skip); elsewhere the fallback is fine."""
    from lab import lab_mode

    assert lab_mode(ci=True) == "netns" and lab_mode(ci=False) == "auto"


def test_up_dry_run_says_what_network_auto_tests_and_a_bad_network_is_a_usage_error(tmp_path: Path):
    inv = tmp_path / "inventory.yaml"
    inv.write_text("cluster: demo\nhosts:\n  - host: gpu-01\n    address: 10.9.9.1\n    ps: 1\n    workers: 1\n")
    runner = CliRunner()
    r = runner.invoke(app, ["up", "--dry-run", str(inv)])
    assert r.exit_code == 0, r.output
    assert ("network: auto: `up` tests whether this machine connects directly to 10.9.9.1:2222, "
            "10.9.9.1:2223; if every one does, direct, else ssh") in r.output
    r = runner.invoke(app, ["up", "--dry-run", "--network", "ssh", str(inv)])
    assert "network: ssh: `dtf train` reaches 10.9.9.1:2222, 10.9.9.1:2223 through SSH" in r.output
    r = runner.invoke(app, ["up", "--dry-run", "--network", "vpn", str(inv)])
    assert r.exit_code == 2 and "--network: expected one of auto, direct, ssh, got 'vpn'" in r.output


def test_output_cut_short_by_its_reader_is_no_internal_error(tmp_path: Path) -> None:
    """`dtf up --dry-run inv | head -1`: the reader goes away while dtf still writes."""
    inv = tmp_path / "inv.yaml"
    inv.write_text("cluster: c\nhosts:\n" + "".join(f"  - {{host: h{i}, ps: 1, workers: 2}}\n" for i in range(200)))
    proc = subprocess.Popen([sys.executable, "-m", "dtf", "up", "--dry-run", str(inv)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env={**os.environ, "DTF_HOME": str(tmp_path / "home")})
    assert proc.stdout is not None and proc.stderr is not None
    assert proc.stdout.readline().startswith(b"cluster c")
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 1
    assert err == "", err


def test_every_commands_help_reads_whole_at_80_columns():
    """At 80 columns, help wraps between words: no line is wider, nothing is cut (`…`), and every
    word of every option's description is there whole."""
    import typer.main

    group = typer.main.get_command(app)
    commands = group.commands  # type: ignore[attr-defined]
    assert "train" in commands and "status" in commands
    env = {**os.environ, "COLUMNS": "80"}
    for name, command in [("", group), *sorted(commands.items())]:
        argv = [sys.executable, "-m", "dtf.cli", *([name] if name else []), "--help"]
        r = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=60)
        assert r.returncode == 0, (name, r.stderr)
        lines = r.stdout.splitlines()
        assert max(len(line) for line in lines) <= 80 and "…" not in r.stdout, (name, r.stdout)
        words = set(r.stdout.split())
        for param in command.params:
            missing = [w for w in (getattr(param, "help", None) or "").split() if w not in words]
            assert missing == [], (name, param.name, missing, r.stdout)
