"""Unit tests for dtf.cluster.inventory: parsing, defaults, port assignment, and every error message."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dtf.cluster.inventory import (
    DEFAULT_PYTHON,
    DEFAULT_RESTART_BACKOFF,
    DEFAULT_RESTART_LIMIT,
    DEFAULT_TF_PORT,
    DEFAULT_WORKDIR,
    HostSpec,
    Inventory,
    Position,
    load,
    loads,
)
from dtf.errors import ExitCode, InventoryError

HOSTS_OK = "hosts:\n  - {host: gpu-01, ps: 1, workers: 1}\n"


def parse(text: str) -> Inventory:
    return loads(textwrap.dedent(text), "inventory.yaml")


def errors(text: str) -> list[str]:
    """The error lines loading `text` produces (it must fail)."""
    with pytest.raises(InventoryError) as info:
        loads(textwrap.dedent(text), "inventory.yaml")
    return info.value.lines()


def host_error(entry: str) -> list[str]:
    """Errors for one extra host entry (line 4) next to a valid one."""
    return errors(f"cluster: demo\nhosts:\n  - {{host: ok, ps: 1, workers: 1}}\n  - {entry}\n")


# -- valid inventories --------------------------------------------------------------------------


def test_minimal_inventory_gets_builtin_defaults() -> None:
    inventory = parse("cluster: demo\n" + HOSTS_OK)
    assert inventory == Inventory(
        path="inventory.yaml",
        cluster="demo",
        ssh_config=None,
        hosts=(
            HostSpec(
                host="gpu-01",
                line=3,
                connection="ssh",
                user=None,
                port=None,
                identity_file=None,
                python=DEFAULT_PYTHON,
                workdir=DEFAULT_WORKDIR,
                address=None,
                ps_ports=(DEFAULT_TF_PORT,),
                worker_ports=(DEFAULT_TF_PORT + 1,),
            ),
        ),
    )
    assert (inventory.num_ps, inventory.num_workers) == (1, 1)


def test_result_is_immutable() -> None:
    inventory = parse("cluster: demo\n" + HOSTS_OK)
    with pytest.raises(dataclasses.FrozenInstanceError):
        inventory.cluster = "other"  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        inventory.hosts[0].port = 1  # type: ignore[misc]
    assert isinstance(inventory.hosts, tuple)


def test_defaults_apply_and_hosts_override() -> None:
    inventory = parse(
        """\
        cluster: demo
        ssh_config: ~/.ssh/config-lab
        defaults:
          user: ubuntu
          port: 2200
          identity_file: ~/.ssh/lab
          python: /opt/tf/bin/python3
          workdir: /scratch/dtf
          tf_port: 3000
          connection: ssh
          address: null
        hosts:
          - {host: gpu-01, ps: 1}
          - {host: 10.0.0.13, user: alice, port: 22, python: python3.11, address: 10.1.0.13, workers: 1}
          - {host: gpu-03, user: null, port: ~, identity_file: null, workers: 1}
        """
    )
    assert inventory.ssh_config == "~/.ssh/config-lab"
    a, b, c = inventory.hosts
    assert (a.user, a.port, a.identity_file, a.python, a.workdir, a.address) == (
        "ubuntu", 2200, "~/.ssh/lab", "/opt/tf/bin/python3", "/scratch/dtf", None
    )
    assert a.ps_ports == (3000,)
    assert (b.user, b.port, b.python, b.address, b.identity_file) == ("alice", 22, "python3.11", "10.1.0.13", "~/.ssh/lab")
    assert (c.user, c.port, c.identity_file) == (None, None, None)  # null: ssh_config decides
    assert [h.line for h in inventory.hosts] == [13, 14, 15]


def test_restart_settings_default_and_override() -> None:
    assert (DEFAULT_RESTART_LIMIT, DEFAULT_RESTART_BACKOFF) == (10, 0.5)
    (h,) = parse("cluster: demo\n" + HOSTS_OK).hosts
    assert (h.restart_limit, h.restart_backoff) == (10, 0.5)
    inventory = parse(
        """\
        cluster: demo
        defaults:
          restart_limit: 3
          restart_backoff: 2
        hosts:
          - {host: a, ps: 1}
          - {host: b, restart_limit: 0, workers: 1}
          - {host: c, restart_backoff: 0.25, workers: 1}
          - {host: d, restart_limit: 1000000, restart_backoff: 3600.0, connection: local, workers: 1}
          - {host: e, restart_limit: 0x10, restart_backoff: 0, tf_port: 3000, workers: 1}
        """
    )
    got = [(h.restart_limit, h.restart_backoff) for h in inventory.hosts]
    assert got == [(3, 2.0), (0, 2.0), (3, 0.25), (1000000, 3600.0), (16, 0.0)]
    assert all(isinstance(h.restart_backoff, float) for h in inventory.hosts)


def test_restart_backoff_minus_zero_is_zero() -> None:
    (h,) = parse("cluster: demo\nhosts:\n  - {host: a, ps: 1, workers: 1, restart_backoff: -0.0}\n").hosts
    assert h.restart_backoff == 0.0 and str(h.restart_backoff) == "0.0"


def test_hostspec_from_an_older_record_gets_restart_defaults() -> None:
    """Records saved before restart_limit/restart_backoff existed still make a HostSpec."""
    (h,) = parse("cluster: demo\n" + HOSTS_OK).hosts
    old = {k: v for k, v in dataclasses.asdict(h).items() if not k.startswith("restart_")}
    assert HostSpec(**old) == h


_LIMIT = "expected a whole number 0..1000000, got"
_BACKOFF = "expected a number of seconds 0..3600, got"


@pytest.mark.parametrize(
    ("setting", "expected"),
    [
        ("restart_limit: -1", f"{_LIMIT} -1"),
        ("restart_limit: 1000001", f"{_LIMIT} 1000001"),
        ("restart_limit: true", f"{_LIMIT} a boolean (true)"),
        ("restart_limit: no", f"{_LIMIT} a boolean (no)"),
        ("restart_limit: 1.5", f"{_LIMIT} 1.5"),
        ("restart_limit: 3.0", f"{_LIMIT} 3.0"),
        ("restart_limit: '3'", f"{_LIMIT} '3'"),
        ("restart_limit: ten", f"{_LIMIT} 'ten'"),
        ("restart_limit: null", f"{_LIMIT} null"),
        ("restart_limit: ", f"{_LIMIT} nothing"),
        ("restart_limit: [1]", f"{_LIMIT} a list"),
        ("restart_limit: .inf", f"{_LIMIT} .inf"),
        (f"restart_limit: {'9' * 60}", f"{_LIMIT} a 60-digit number"),
        ("restart_backoff: -0.5", f"{_BACKOFF} -0.5"),
        ("restart_backoff: 3600.5", f"{_BACKOFF} 3600.5"),
        ("restart_backoff: 100000000000000000000000", f"{_BACKOFF} a 24-digit number"),
        ("restart_backoff: yes", f"{_BACKOFF} a boolean (yes)"),
        ("restart_backoff: .nan", f"{_BACKOFF} .nan"),
        ("restart_backoff: .inf", f"{_BACKOFF} .inf"),
        ("restart_backoff: -.inf", f"{_BACKOFF} -.inf"),
        ("restart_backoff: '1'", f"{_BACKOFF} '1'"),
        ("restart_backoff: 1s", f"{_BACKOFF} '1s'"),
        ("restart_backoff: ~", f"{_BACKOFF} null"),
        ("restart_backoff: {a: 1}", f"{_BACKOFF} a mapping"),
        ("restart_backoff: !!python/object/apply:time.sleep [9]", "unsupported YAML tag '!!python/object/apply:time.sleep'"),
    ],
)
def test_restart_setting_errors(setting: str, expected: str) -> None:
    key = setting.split(":")[0]
    assert host_error(f"{{host: b, {setting}}}") == [f"inventory.yaml:4:15: hosts[1].{key}: {expected}"]
    assert errors(f"cluster: demo\ndefaults:\n  {setting}\n" + HOSTS_OK) == [
        f"inventory.yaml:3:3: defaults.{key}: {expected}"
    ]


def test_block_style_host_line_is_the_entry() -> None:
    inventory = parse("cluster: demo\nhosts:\n\n  - host: a\n    ps: 1\n  -\n    host: b\n    workers: 1\n")
    assert [h.line for h in inventory.hosts] == [4, 7]  # where the mapping itself starts


def test_paths_may_contain_spaces_and_quotes() -> None:
    inventory = parse(
        """\
        cluster: demo
        ssh_config: "~/my ssh/config"
        hosts:
          - host: a
            python: "/opt/my env/bin/python3"
            workdir: "~/it's here"
            identity_file: '~/keys/"lab" key'
            ps: 1
            workers: 1
        """
    )
    (h,) = inventory.hosts
    assert (h.python, h.workdir, h.identity_file) == ("/opt/my env/bin/python3", "~/it's here", '~/keys/"lab" key')


def test_ipv6_and_dotted_names_are_fine() -> None:
    inventory = parse("cluster: a.b_c-1\nhosts:\n  - {host: 'fe80::1%eth0', ps: 1}\n  - {host: gpu-01.lab.example.com, workers: 1}\n")
    assert [h.host for h in inventory.hosts] == ["fe80::1%eth0", "gpu-01.lab.example.com"]


def test_cluster_name_length_limit() -> None:
    assert parse(f"cluster: {'a' * 63}\n" + HOSTS_OK).cluster == "a" * 63
    assert errors(f"cluster: {'a' * 64}\n" + HOSTS_OK) == [
        "inventory.yaml:1:1: cluster: expected a cluster name of at most 63 letters, digits, '_', '.' or '-', "
        f"starting with a letter or digit, got '{'a' * 40}...'"
    ]


def test_ipv6_hosts_and_users_with_at_or_colon_are_fine() -> None:
    inventory = parse(
        "cluster: demo\nhosts:\n  - {host: '::1', address: 'fd00::1', ps: 1}\n"
        "  - {host: b, user: alice@corp.example, workers: 1}\n  - {host: c, user: 'a:b', workers: 1}\n"
    )
    assert [(h.host, h.address, h.user) for h in inventory.hosts] == [
        ("::1", "fd00::1", None), ("b", None, "alice@corp.example"), ("c", None, "a:b")
    ]


def test_anchors_and_aliases_work() -> None:
    inventory = parse("cluster: demo\nhosts:\n  - {host: &h gpu-01, python: &py /opt/py, ps: 1}\n  - {host: *h, python: *py, tf_port: 3000, workers: 1}\n")
    assert [(h.host, h.python) for h in inventory.hosts] == [("gpu-01", "/opt/py"), ("gpu-01", "/opt/py")]


def test_explicit_str_tag_makes_a_number_a_string() -> None:
    inventory = parse("cluster: demo\nhosts:\n  - {host: gpu-01, user: !!str 1001, ps: 1, workers: 1}\n")
    assert inventory.hosts[0].user == "1001"


def test_bom_is_accepted(tmp_path: Path) -> None:
    path = tmp_path / "inv.yaml"
    path.write_bytes(b"\xef\xbb\xbfcluster: demo\n" + HOSTS_OK.encode())
    assert load(path).cluster == "demo"


# -- port assignment -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("entry", "ps", "workers"),
    [
        ("{host: a, ps: 1, workers: 2}", (2222,), (2223, 2224)),
        ("{host: a, ps: 2, workers: 3, tf_port: 5000}", (5000, 5001), (5002, 5003, 5004)),
        ("{host: a, ps: [2300], workers: [2301, 2302]}", (2300,), (2301, 2302)),
        ("{host: a, ps: [2222], workers: 2}", (2222,), (2223, 2224)),
        ("{host: a, ps: [2223], workers: 2}", (2223,), (2222, 2224)),
        ("{host: a, ps: 2, workers: [2222, 2224]}", (2223, 2225), (2222, 2224)),
        ("{host: a, ps: 1, workers: [9000], tf_port: 9000}", (9001,), (9000,)),
        ("{host: a, ps: 1, workers: 0}", (2222,), ()),
        ("{host: a, ps: 1, workers: []}", (2222,), ()),
        ("{host: a, ps: 1, workers: 1, tf_port: 65534}", (65534,), (65535,)),
        ("{host: a, ps: [1, 65535]}", (1, 65535), ()),
    ],
)
def test_port_assignment(entry: str, ps: tuple[int, ...], workers: tuple[int, ...]) -> None:
    inventory = parse(f"cluster: demo\nhosts:\n  - {entry}\n  - {{host: other, ps: 1, workers: 1}}\n")
    assert (inventory.hosts[0].ps_ports, inventory.hosts[0].worker_ports) == (ps, workers)


def test_same_host_twice_without_collision_is_fine() -> None:
    inventory = parse("cluster: demo\nhosts:\n  - {host: gpu-01, ps: 1}\n  - {host: gpu-01, tf_port: 2300, workers: 2}\n")
    assert [(h.ps_ports, h.worker_ports) for h in inventory.hosts] == [((2222,), ()), ((), (2300, 2301))]


def test_same_port_on_different_hosts_is_fine() -> None:
    inventory = parse("cluster: demo\nhosts:\n  - {host: a, ps: 1}\n  - {host: b, workers: 1}\n")
    assert [h.ps_ports + h.worker_ports for h in inventory.hosts] == [(2222,), (2222,)]


@settings(max_examples=100, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 4), st.integers(0, 4), st.integers(1, 65535 - 8)),
        min_size=1,
        max_size=6,
    ).filter(lambda hs: any(h[0] for h in hs) and any(h[1] for h in hs))
)
def test_property_counted_ports_are_consecutive(hosts: list[tuple[int, int, int]]) -> None:
    entries = "".join(f"  - {{host: h{i}, ps: {ps}, workers: {w}, tf_port: {t}}}\n" for i, (ps, w, t) in enumerate(hosts))
    inventory = parse("cluster: demo\nhosts:\n" + entries)
    for spec, (ps, workers, tf_port) in zip(inventory.hosts, hosts):
        assert spec.ps_ports + spec.worker_ports == tuple(range(tf_port, tf_port + ps + workers))
        assert (len(spec.ps_ports), len(spec.worker_ports)) == (ps, workers)
    assert (inventory.num_ps, inventory.num_workers) == (sum(h[0] for h in hosts), sum(h[1] for h in hosts))


def test_tasks_per_host_limit_is_inclusive() -> None:
    inventory = parse("cluster: demo\nhosts:\n  - {host: a, ps: 1, workers: 999}\n")
    assert len(inventory.hosts[0].worker_ports) == 999


# -- connection: local ---------------------------------------------------------------------------


def test_local_connection_drops_ssh_settings() -> None:
    inventory = parse(
        """\
        cluster: local
        defaults: {user: ubuntu, port: 2200, identity_file: ~/.ssh/lab}
        hosts:
          - {host: localhost, connection: local, ps: 1, workers: 2}
          - {host: gpu-01, workers: 1}
        """
    )
    local, remote = inventory.hosts
    assert (local.connection, local.user, local.port, local.identity_file) == ("local", None, None, None)
    assert (remote.connection, remote.user, remote.port, remote.identity_file) == ("ssh", "ubuntu", 2200, "~/.ssh/lab")


def test_local_hosts_share_one_machine() -> None:
    text = "cluster: l\ndefaults: {connection: local}\nhosts:\n  - {host: localhost, ps: 1}\n  - {host: 127.0.0.1, workers: 1}\n"
    assert errors(text) == [
        "inventory.yaml:5:23: hosts[1].workers: port 2222 on the local machine is already used by hosts[0].ps (line 4)"
    ]
    assert parse(text.replace("workers: 1}", "workers: 1, tf_port: 2300}")).num_workers == 1


def test_local_and_ssh_host_of_the_same_name_do_not_collide() -> None:
    inventory = parse("cluster: l\nhosts:\n  - {host: localhost, connection: local, ps: 1}\n  - {host: localhost, workers: 1}\n")
    assert [h.connection for h in inventory.hosts] == ["local", "ssh"]


# -- errors: one class at a time, exact lines ------------------------------------------------------


def test_the_brief_example() -> None:
    text = "cluster: demo\nhosts:\n  - host: a\n    ps: 1\n  - host: b\n    port: 22\n    workers: two\n"
    assert errors(text) == [
        "inventory.yaml:7:5: hosts[1].workers: expected a whole number >= 0 or a list of ports, got 'two'"
    ]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("cluster: demo\nhots: []\n", "inventory.yaml:2:1: hots: unknown key (did you mean 'hosts'?)"),
        ("cluster: demo\ndefault: {}\n" + HOSTS_OK, "inventory.yaml:2:1: default: unknown key (did you mean 'defaults'?)"),
        ("cluster: demo\nfoo: 1\n" + HOSTS_OK, "inventory.yaml:2:1: foo: unknown key"),
        ("cluster: demo\ndefaults: {usr: x}\n" + HOSTS_OK, "inventory.yaml:2:12: defaults.usr: unknown key (did you mean 'user'?)"),
        ("cluster: demo\ndefaults: {workers: 1}\n" + HOSTS_OK, "inventory.yaml:2:12: defaults.workers: not allowed in defaults: set it in each hosts entry"),
        ("cluster: demo\n" + HOSTS_OK + "  - {host: b, wokers: 1}\n", "inventory.yaml:4:15: hosts[1].wokers: unknown key (did you mean 'workers'?)"),
        ("cluster: demo\n" + HOSTS_OK + "  - {hostname: b}\n", "inventory.yaml:4:6: hosts[1].hostname: unknown key (did you mean 'host'?)"),
        ("cluster: demo\n" + HOSTS_OK + "  - {host: b, 'a b': 1}\n", "inventory.yaml:4:15: hosts[1].'a b': unknown key"),
    ],
)
def test_unknown_keys(text: str, expected: str) -> None:
    assert expected in errors(text)


def test_merge_keys_are_refused() -> None:
    assert host_error("{<<: {host: b}}") == [
        "inventory.yaml:4:5: hosts[1]: missing required key 'host'",
        "inventory.yaml:4:6: hosts[1]: YAML merge keys (<<) are not supported; use defaults",
    ]


def test_missing_required_keys() -> None:
    assert errors("ssh_config: x\n") == [
        "inventory.yaml:1:1: missing required key 'cluster'",
        "inventory.yaml:1:1: missing required key 'hosts'",
    ]
    assert errors("cluster: demo\nhosts:\n  - {host: a, ps: 1, workers: 1}\n  - {ps: 1}\n") == [
        "inventory.yaml:4:5: hosts[1]: missing required key 'host'"
    ]


@pytest.mark.parametrize(
    ("entry", "expected"),
    [
        ("{host: b, port: yes}", "4:15: hosts[1].port: expected a port number 1..65535, got a boolean (yes)"),
        ("{host: b, port: true}", "4:15: hosts[1].port: expected a port number 1..65535, got a boolean (true)"),
        ("{host: b, port: 0}", "4:15: hosts[1].port: expected a port number 1..65535, got 0"),
        ("{host: b, port: 65536}", "4:15: hosts[1].port: expected a port number 1..65535, got 65536"),
        ("{host: b, port: 22.0}", "4:15: hosts[1].port: expected a port number 1..65535, got 22.0"),
        ("{host: b, port: '22'}", "4:15: hosts[1].port: expected a port number 1..65535, got '22'"),
        ("{host: b, port: [22]}", "4:15: hosts[1].port: expected a port number 1..65535, got a list"),
        ("{host: b, tf_port: -1}", "4:15: hosts[1].tf_port: expected a port number 1..65535, got -1"),
        ("{host: b, tf_port: null}", "4:15: hosts[1].tf_port: expected a port number 1..65535, got null"),
        ("{host: b, user: 123}", "4:15: hosts[1].user: expected a user name, got 123"),
        ("{host: b, user: ''}", "4:15: hosts[1].user: expected a user name, got an empty string"),
        ("{host: b, user: {a: 1}}", "4:15: hosts[1].user: expected a user name, got a mapping"),
        ("{host: b, python: 3}", "4:15: hosts[1].python: expected a path, got 3"),
        ("{host: b, python: }", "4:15: hosts[1].python: expected a path, got nothing"),
        ("{host: b, workdir: 2024-01-01}", "4:15: hosts[1].workdir: expected a path, got a date (2024-01-01)"),
        ("{host: b, python: \"/usr/bin/python3\\n\"}", "4:15: hosts[1].python: expected a path without newlines or NUL characters, got '/usr/bin/python3\\n'"),
        ("{host: b, workdir: \"a\\0b\"}", "4:15: hosts[1].workdir: expected a path without newlines or NUL characters, got 'a\\x00b'"),
        ("{host: b, connection: sshh}", "4:15: hosts[1].connection: expected 'ssh' or 'local', got 'sshh'"),
        ("{host: b, address: 'a b'}", "4:15: hosts[1].address: expected an address without whitespace, got 'a b'"),
        ("{host: 12}", "4:6: hosts[1].host: expected a host name, got 12"),
        ("{host: ''}", "4:6: hosts[1].host: expected a host name, got an empty string"),
        ("{host: null}", "4:6: hosts[1].host: expected a host name, got null"),
        ("{host: 'gpu 01'}", "4:6: hosts[1].host: expected a host name without whitespace, got 'gpu 01'"),
        ("{host: 'gpu\t01'}", "4:6: hosts[1].host: expected a host name without control characters or newlines, got 'gpu\\t01'"),
        ("{host: \"gpu\\n01\"}", "4:6: hosts[1].host: expected a host name without control characters or newlines, got 'gpu\\n01'"),
        ("{host: 'a;b'}", "4:6: hosts[1].host: expected a host name without quotes or shell characters such as ; $ ` ( ) < > |, got 'a;b'"),
        ("{host: '$(touch x)'}", "4:6: hosts[1].host: expected a host name without quotes or shell characters such as ; $ ` ( ) < > |, got '$(touch x)'"),
        ("{host: '`id`'}", "4:6: hosts[1].host: expected a host name without quotes or shell characters such as ; $ ` ( ) < > |, got '`id`'"),
        ("{host: \"o'brien\"}", "4:6: hosts[1].host: expected a host name without quotes or shell characters such as ; $ ` ( ) < > |, got \"o'brien\""),
        # SSH reads user@host:port out of a host string: those go in user: and port:.
        ("{host: ubuntu@gpu-01}", "4:6: hosts[1].host: expected a host name without '@' (set the login name with user:), got 'ubuntu@gpu-01'"),
        ("{host: gpu-01@}", "4:6: hosts[1].host: expected a host name without '@' (set the login name with user:), got 'gpu-01@'"),
        ("{host: 'gpu-01:2200'}", "4:6: hosts[1].host: expected a host name without ':PORT' (set the SSH port with port:), got 'gpu-01:2200'"),
        ("{host: 'a:b'}", "4:6: hosts[1].host: expected a host name without ':PORT' (set the SSH port with port:), got 'a:b'"),
        ("{host: b, address: '10.0.0.1:2222'}", "4:15: hosts[1].address: expected an address without ':PORT' (TF ports come from ps, workers and tf_port), got '10.0.0.1:2222'"),
        ("{host: b, address: u@10.0.0.1}", "4:15: hosts[1].address: expected an address without '@', got 'u@10.0.0.1'"),
        ("{host: '-oProxyCommand=x'}", "4:6: hosts[1].host: expected a host name not starting with '-', got '-oProxyCommand=x'"),
        ("{host: b, workers: two}", "4:15: hosts[1].workers: expected a whole number >= 0 or a list of ports, got 'two'"),
        ("{host: b, workers: -1}", "4:15: hosts[1].workers: expected a whole number >= 0 or a list of ports, got -1"),
        ("{host: b, workers: 1.5}", "4:15: hosts[1].workers: expected a whole number >= 0 or a list of ports, got 1.5"),
        ("{host: b, workers: yes}", "4:15: hosts[1].workers: expected a whole number >= 0 or a list of ports, got a boolean (yes)"),
        ("{host: b, workers: {a: 1}}", "4:15: hosts[1].workers: expected a whole number >= 0 or a list of ports, got a mapping"),
        ("{host: b, ps: [2300, x]}", "4:26: hosts[1].ps[1]: expected a port number 1..65535, got 'x'"),
        ("{host: b, ps: [0]}", "4:20: hosts[1].ps[0]: expected a port number 1..65535, got 0"),
        ("{host: b, ps: [[1]]}", "4:20: hosts[1].ps[0]: expected a port number 1..65535, got a list"),
        ("{host: b, workers: 1001}", "4:15: hosts[1].workers: expected at most 1000 tasks per host, got 1001"),
        ("{host: b, workers: 1000000000000000000000000000000}", "4:15: hosts[1].workers: expected at most 1000 tasks per host, got a 31-digit number"),
        (f"{{host: b, workers: {'9' * 5000}}}", "4:15: hosts[1].workers: expected at most 1000 tasks per host, got a 5000-digit number"),
        ("{host: b, ps: 600, workers: 600}", "4:24: hosts[1].workers: expected at most 1000 tasks per host, got 1200"),
        (f"{{host: b, ps: [{', '.join(['1'] * 1001)}]}}", "4:15: hosts[1].ps: expected at most 1000 tasks per host, got 1001 ports"),
        ("{host: b, tf_port: 65535, ps: 1, workers: 1}", "4:38: hosts[1].workers: expected ports 1..65535, but counting up from tf_port 65535 reaches 65536"),
        ("{host: b, user: !!python/object/apply:os.system [id]}", "4:15: hosts[1].user: unsupported YAML tag '!!python/object/apply:os.system'"),
        ("{host: b, user: !custom x}", "4:15: hosts[1].user: unsupported YAML tag '!custom'"),
        ("{host: b, port: !!int ''}", "4:15: hosts[1].port: invalid !!int value ''"),
        ("{host: b, port: !!binary aGVsbG8=}", "4:15: hosts[1].port: unsupported YAML tag '!!binary'"),
        ("{host: b, host: c}", "4:15: hosts[1].host: duplicate key (first given at line 4)"),
        ("{host: b, 1: x}", "4:15: hosts[1]: expected a key name, got 1"),
        ("[host, b]", "4:5: hosts[1]: expected a mapping with at least a host key, got a list"),
        ("gpu-02", "4:5: hosts[1]: expected a mapping with at least a host key, got 'gpu-02'"),
    ],
)
def test_host_entry_errors(entry: str, expected: str) -> None:
    assert host_error(entry) == [f"inventory.yaml:{expected}"]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("cluster: 'my cluster'\n", "1:1: cluster: expected a cluster name of at most 63 letters, digits, '_', '.' or '-', starting with a letter or digit, got 'my cluster'"),
        ("cluster: -demo\n", "1:1: cluster: expected a cluster name of at most 63 letters, digits, '_', '.' or '-', starting with a letter or digit, got '-demo'"),
        ("cluster: 42\n", "1:1: cluster: expected a cluster name, got 42"),
        ("cluster: \"demo\\n\"\n", "1:1: cluster: expected a cluster name of at most 63 letters, digits, '_', '.' or '-', starting with a letter or digit, got 'demo\\n'"),
        ("cluster: demo\nssh_config: [a]\n", "2:1: ssh_config: expected a path, got a list"),
        ("cluster: demo\ndefaults: [user]\n", "2:1: defaults: expected a mapping of host settings, got a list"),
        ("cluster: demo\ndefaults: {port: yes}\n", "2:12: defaults.port: expected a port number 1..65535, got a boolean (yes)"),
        ("cluster: demo\ncluster: demo\n", "2:1: cluster: duplicate key (first given at line 1)"),
    ],
)
def test_top_level_errors(text: str, expected: str) -> None:
    lines = errors(text + ("" if "hosts" in text else "hosts:\n  - {host: a, ps: 1, workers: 1}\n"))
    assert lines == [f"inventory.yaml:{expected}"]


@pytest.mark.parametrize(
    ("hosts", "expected"),
    [
        ("hosts: []\n", ["2:1: hosts: expected a non-empty list of hosts, got an empty list"]),
        ("hosts:\n", ["2:1: hosts: expected a non-empty list of hosts, got nothing"]),
        ("hosts: {host: a}\n", ["2:1: hosts: expected a non-empty list of hosts, got a mapping"]),
        ("hosts: [{host: a, ps: [2300]}]\n", ["2:1: hosts: no worker task: at least one host needs workers: 1 or more"]),
        (
            "hosts: [{host: a}]\n",
            ["2:1: hosts: no worker task: at least one host needs workers: 1 or more"],
        ),
        # An invalid ps value is reported as itself, not also as "no ps task".
        ("hosts: [{host: a, ps: x, workers: 1}]\n", ["2:19: hosts[0].ps: expected a whole number >= 0 or a list of ports, got 'x'"]),
        # A host with a bad setting still counts its tasks.
        ("hosts: [{host: a, ps: 1, workers: 1, port: 0}]\n", ["2:38: hosts[0].port: expected a port number 1..65535, got 0"]),
    ],
)
def test_cluster_needs_a_worker(hosts: str, expected: list[str]) -> None:
    assert errors("cluster: demo\n" + hosts) == [f"inventory.yaml:{e}" for e in expected]


def test_a_cluster_without_ps_is_one_for_collective_mode() -> None:
    inv = loads("cluster: demo\nhosts: [{host: a, workers: 2}]\n", "inventory.yaml")
    assert [h.worker_ports for h in inv.hosts] == [(2222, 2223)]


def test_duplicate_ports() -> None:
    assert errors(
        """\
        cluster: demo
        hosts:
          - host: gpu-01
            ps: 1
            workers: [2300, 2300]
          - host: GPU-01
            workers: 2
          - host: gpu-01
            workers: [2223, 2400]
        """
    ) == [
        "inventory.yaml:5:21: hosts[0].workers[1]: port 2300 on host 'gpu-01' is already used by hosts[0].workers[0] (line 5)",
        # Host names compare case-insensitively; one problem per counted role, at its key.
        "inventory.yaml:7:5: hosts[1].workers: port 2222 on host 'GPU-01' is already used by hosts[0].ps (line 4)",
        "inventory.yaml:9:15: hosts[2].workers[0]: port 2223 on host 'gpu-01' is already used by hosts[1].workers (line 7)",
    ]


def test_duplicate_ports_counted_against_explicit() -> None:
    assert errors("cluster: demo\nhosts:\n  - {host: a, ps: [2223]}\n  - {host: a, workers: 2}\n") == [
        "inventory.yaml:4:15: hosts[1].workers: port 2223 on host 'a' is already used by hosts[0].ps[0] (line 3)"
    ]


def test_all_problems_are_reported_together_in_file_order() -> None:
    lines = errors(
        """\
        cluster: demo
        defaults:
          tf_prot: 3000
        hosts:
          - host: gpu-01
            ps: 1
          - host: "bad host"
            workers: two
          - host: gpu-03
            user: 123
            workers: 1
          - {host: gpu-01, ps: 1}
        extra: 1
        """
    )
    assert lines == [
        "inventory.yaml:3:3: defaults.tf_prot: unknown key (did you mean 'tf_port'?)",
        "inventory.yaml:7:5: hosts[1].host: expected a host name without whitespace, got 'bad host'",
        "inventory.yaml:8:5: hosts[1].workers: expected a whole number >= 0 or a list of ports, got 'two'",
        "inventory.yaml:10:5: hosts[2].user: expected a user name, got 123",
        "inventory.yaml:12:20: hosts[3].ps: port 2222 on host 'gpu-01' is already used by hosts[0].ps (line 6)",
        "inventory.yaml:13:1: extra: unknown key",
    ]


def test_error_carries_problems_and_exit_code() -> None:
    with pytest.raises(InventoryError) as info:
        loads("cluster: demo\nhosts: []\n", "x.yaml")
    error = info.value
    assert error.exit_code == ExitCode.INVENTORY
    (problem,) = error.problems
    assert (problem.file, problem.line, problem.column, problem.path) == ("x.yaml", 2, 1, "hosts")
    assert str(error) == "x.yaml:2:1: hosts: expected a non-empty list of hosts, got an empty list"


# -- whole-document and syntax errors ------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("", "1:1: the file is empty; expected a mapping with keys cluster and hosts"),
        ("# only a comment\n", "1:1: the file is empty; expected a mapping with keys cluster and hosts"),
        ("- a\n- b\n", "1:1: expected a mapping with keys cluster and hosts, got a list"),
        ("hello\n", "1:1: expected a mapping with keys cluster and hosts, got 'hello'"),
        ("~\n", "1:1: expected a mapping with keys cluster and hosts, got null"),
        ("!!python/object/apply:os.system ['touch /tmp/x']\n", "1:1: expected a mapping with keys cluster and hosts, got a value with the unsupported tag '!!python/object/apply:os.system'"),
        ("cluster: demo\nhosts: [\n", "3:1: invalid YAML: expected the node content, but found '<stream end>'"),
        ("cluster: demo\nhosts:\n\t- {host: a}\n", "3:1: invalid YAML: found character '\\t' that cannot start any token (indent with spaces, not tabs)"),
        ("cluster: 'demo\n", "2:1: invalid YAML: found unexpected end of stream"),
        ("cluster: demo\n  hosts: x\n", "2:8: invalid YAML: mapping values are not allowed here"),
        ("a: 1\n---\nb: 2\n", "2:1: invalid YAML: expected a single document in the stream, but found another document"),
        ("cluster: *nope\n", "1:10: invalid YAML: found undefined alias 'nope'"),
        ("cluster: demo\x00\n", "1:14: invalid YAML: unacceptable character #x0000 (special characters are not allowed)"),
        ("[" * 100_000, "1:1: invalid YAML: nested too deeply"),
        # A reader error counts line breaks as YAML does, like every other error: a lone \r too.
        ("cluster: demo\rhosts: x\x00\r", "2:9: invalid YAML: unacceptable character #x0000 (special characters are not allowed)"),
        ("cluster: demo\r\nhosts: x\x00\r\n", "2:9: invalid YAML: unacceptable character #x0000 (special characters are not allowed)"),
        ("cluster: demo\u2028hosts: \x07\n", "2:8: invalid YAML: unacceptable character #x0007 (special characters are not allowed)"),
    ],
)
def test_document_errors(text: str, expected: str) -> None:
    assert errors(text) == [f"inventory.yaml:{expected}"]


# -- load() ----------------------------------------------------------------------------------------


def test_load_reads_the_file_and_names_it(tmp_path: Path) -> None:
    path = tmp_path / "inv.yaml"
    path.write_text("cluster: demo\n" + HOSTS_OK, encoding="utf-8")
    assert load(path).path == str(path)
    assert load(str(path)).cluster == "demo"
    path.write_text("cluster: demo\nhosts: []\n", encoding="utf-8")
    with pytest.raises(InventoryError) as info:
        load(path)
    assert info.value.lines() == [f"{path}:2:1: hosts: expected a non-empty list of hosts, got an empty list"]


def test_load_missing_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(InventoryError) as info:
        load("inv.yaml")
    assert info.value.lines() == ["inv.yaml:1:1: cannot read file: No such file or directory"]


def test_load_directory(tmp_path: Path) -> None:
    with pytest.raises(InventoryError) as info:
        load(tmp_path)
    assert info.value.lines() == [f"{tmp_path}:1:1: cannot read file: Is a directory"]


def test_load_bad_path() -> None:
    with pytest.raises(InventoryError) as info:
        load("a\0b")
    assert info.value.lines()[0].startswith("a\0b:1:1: cannot read file: ")


def test_load_not_utf8(tmp_path: Path) -> None:
    path = tmp_path / "inv.yaml"
    path.write_bytes(b"cluster: demo\nhosts: \xff\xfe\n")
    with pytest.raises(InventoryError) as info:
        load(path)
    assert info.value.lines() == [f"{path}:2:8: cannot read file: not UTF-8 text"]
    path.write_bytes(b"cluster: demo\rhosts:\r\n  - \xff\n")
    with pytest.raises(InventoryError) as info:
        load(path)
    assert info.value.lines() == [f"{path}:3:5: cannot read file: not UTF-8 text"]


# -- never a traceback -----------------------------------------------------------------------------

HOSTILE = [
    "",
    " ",
    "\n\n\n",
    "---\n",
    "...\n",
    "- 1\n- 2\n",
    "42\n",
    "3.14\n",
    "true\n",
    "null\n",
    '"just a string"\n',
    "{{{{\n",
    "cluster: [unclosed\n",
    "cluster: demo\nhosts:\n\t- host: a\n",
    "cluster:\n  - a\n  - b\nhosts: 7\n",
    "cluster: {a: b}\nhosts: {host: x}\n",
    "hosts: [1, 2, 3]\n",
    "hosts: [[], {}, null, '', 0]\n",
    "cluster: demo\nhosts: [{}]\n",
    "cluster: demo\nhosts: [{host: [a]}]\n",
    "cluster: demo\nhosts: [{host: {a: b}}]\n",
    "cluster: demo\nhosts: [{host: a, ps: 1, workers: 1}, {host: a, ps: 1, workers: 1}]\n",
    "cluster: demo\nhosts: [{host: a, ps: [2222, 2222, 2222], workers: [2222]}]\n",
    "cluster: demo\nhosts: [{host: a, workers: 1e400}]\n",
    "cluster: demo\nhosts: [{host: a, workers: .nan, ps: -.inf}]\n",
    "cluster: demo\nhosts: [{host: a, workers: 0x7fffffffffffffffffffffffffffffff}]\n",
    f"cluster: demo\nhosts: [{{host: a, workers: {'1' * 100_000}}}]\n",
    "cluster: demo\nhosts: [{host: a, workers: 1:30:00:00:00:00:00:00:00}]\n",
    "cluster: demo\nhosts: [{host: 'a b c', ps: 1}]\n",
    'cluster: demo\nhosts: [{host: "a\\"b", ps: 1}]\n',
    "cluster: demo\nhosts: [{host: 'x; rm -rf /', ps: 1}]\n",
    "cluster: demo\nhosts: [{host: '$(touch x)', ps: 1}]\n",
    "cluster: demo\nhosts: [{host: \"a\\nb\", ps: 1}]\n",
    "cluster: demo\nhosts: [{host: \"\\u202e\", ps: 1}]\n",
    "!!python/object/apply:os.system ['touch /tmp/pwned']\n",
    "cluster: !!python/object/apply:os.system ['id']\nhosts: !!python/name:os.system\n",
    "cluster: !!python/object/new:type [x, [], {}]\n",
    "cluster: demo\nhosts: !!set {a, b}\n",
    "cluster: demo\nhosts: !!omap [{a: 1}]\n",
    "cluster: demo\nhosts: [{host: a, ps: !!timestamp 2001-13-45}]\n",
    "cluster: demo\nhosts: [{host: a, ps: !!float x, workers: !!bool maybe}]\n",
    "cluster: demo\nhosts: [{host: a, ps: !!null x, workers: !!int 0b}]\n",
    "? [complex, key]\n: value\n",
    "? {a: b}\n: value\ncluster: demo\n",
    "&a [*a]\n",
    "cluster: demo\nhosts: &h [{host: a, ps: *h}]\n",
    "cluster: demo\nhosts: &h [*h]\n",
    "a: &a [*a, *a, *a, *a, *a, *a, *a, *a, *a]\nb: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a]\nc: [*b, *b, *b, *b, *b]\n",
    "<<: {cluster: demo}\nhosts: []\n",
    "cluster: demo\nhosts:\n  - <<: {host: a}\n    ps: 1\n",
    "%YAML 1.1\n---\ncluster: demo\n",
    "%TAG ! tag:evil.com,2000:\n---\ncluster: !x demo\n",
    "cluster: demo\x00\n",
    "cluster: \ud800\n",
    "\x1b[31mred\x1b[0m: 1\n",
    "\ufeffcluster: demo\n",
    "cluster: demo\r\nhosts:\r\n  - {host: a, ps: 1}\r\n",
    "[" * 50_000,
    "- " * 5_000 + "x\n",
    "a:\n" + "  " * 2_000 + "b: 1\n",
    "cluster: " + "x" * 1_000_000 + "\n",
]


@pytest.mark.parametrize("text", HOSTILE, ids=range(len(HOSTILE)))
def test_hostile_input_gives_only_inventory_errors(text: str) -> None:
    try:
        result = loads(text, "inventory.yaml")
    except InventoryError as e:
        assert e.problems
        for line in e.lines():
            assert line.startswith("inventory.yaml:")
            assert "\n" not in line  # one problem, one line: control characters are escaped
    else:
        assert isinstance(result, Inventory)


_KEYS = ["cluster", "hosts", "defaults", "ssh_config", "host", "ps", "workers", "port", "tf_port", "user",
         "connection", "address", "python", "workdir", "identity_file", "restart_limit", "restart_backoff", "wokers"]
_leaves = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(10**40), max_value=10**40),
    st.integers(min_value=0, max_value=3),
    st.integers(min_value=2220, max_value=2226),
    st.floats(allow_nan=True),
    st.text(max_size=12),
    st.sampled_from(["local", "ssh", "gpu-01", "localhost", "a b", "$(x)", "-o", "demo", ""]),
)
_keys = st.one_of(st.sampled_from(_KEYS), st.text(max_size=6))
_structures = st.recursive(
    _leaves,
    lambda children: st.one_of(st.lists(children, max_size=4), st.dictionaries(_keys, children, max_size=5)),
    max_leaves=25,
)
_host = st.dictionaries(st.sampled_from(_KEYS[4:]), _structures, max_size=5)
_inventories = st.fixed_dictionaries(
    {"cluster": _leaves, "hosts": st.lists(_host, max_size=4)},
    optional={"defaults": st.dictionaries(st.sampled_from(_KEYS[4:]), _leaves, max_size=3), "ssh_config": _leaves},
)


def _loads_or_inventory_error(text: str) -> None:
    try:
        assert isinstance(loads(text, "inventory.yaml"), Inventory)
    except InventoryError as e:
        assert e.problems and all(p.line >= 1 and p.column >= 1 for p in e.problems)


@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(_structures, _inventories))
def test_property_dumped_structures(data: object) -> None:
    _loads_or_inventory_error(yaml.safe_dump(data, allow_unicode=True))


@settings(deadline=None)
@given(
    st.lists(
        st.one_of(
            st.sampled_from(["cluster:", "hosts:", "- ", "  ", "{", "}", "[", "]", ":", ",", "\n", "\t", "&a ", "*a",
                             "!!python/object ", "!!int ", "'", '"', "#", "?", "host: ", "ps: ", "workers: ", "---", "|"]),
            st.text(max_size=5),
        ),
        max_size=30,
    ).map("".join)
)
def test_property_yamlish_text(text: str) -> None:
    _loads_or_inventory_error(text)


def test_network_and_firewall_keys() -> None:
    base = "cluster: c\nhosts:\n  - host: a\n    ps: 1\n    workers: 1\n"
    inv = loads(base)
    assert (inv.network, inv.firewall) == ("auto", "auto")
    inv = loads("network: ssh\nfirewall: members\n" + base)
    assert (inv.network, inv.firewall) == ("ssh", "members")
    assert loads("firewall: off\n" + base).firewall == "off"  # (a boolean to YAML 1.1: taken as written)
    assert loads("firewall: 'off'\n" + base).firewall == "off"
    with pytest.raises(InventoryError) as e:
        loads("network: tunnel\nfirewall: yes\n" + base, "inv.yaml")
    assert e.value.lines() == ["inv.yaml:1:1: network: expected 'auto', 'direct' or 'ssh', got 'tunnel'",
                               "inv.yaml:2:1: firewall: expected 'auto', 'members' or 'off', got a boolean (yes)"]
    with pytest.raises(InventoryError) as e:  # the old name of off
        loads("firewall: none\n" + base, "inv.yaml")
    assert e.value.lines() == [
        "inv.yaml:1:1: firewall: 'none' is now called 'off' (the TF ports open to anyone who reaches them); "
        "without the key, auto closes them to all but the cluster where the host allows it"]
    with pytest.raises(InventoryError) as e:
        loads("netwrk: ssh\n" + base, "inv.yaml")
    assert e.value.lines() == ["inv.yaml:1:1: netwrk: unknown key (did you mean 'network'?)"]


def test_an_inventory_knows_where_each_value_is_written() -> None:
    """Each value's position, by the name its errors give it: a key's for a mapping's entry, an
    item's for a list's; what is not written is at the file's start."""
    inv = loads("cluster: demo\nssh_config: /dev/null\nhosts:\n  - host: a\n    ps: [2300, 2301]\n"
                "    workers: 1\n  - {host: b, workers: 1}\nsync:\n  - data\n", "inv.yaml")
    assert inv.position("ssh_config") == Position("inv.yaml", 2, 1)
    assert inv.position("hosts[0]") == Position("inv.yaml", 4, 5)
    assert inv.position("hosts[0].ps[1]") == Position("inv.yaml", 5, 16)
    assert inv.position("hosts[1].workers") == Position("inv.yaml", 7, 15)
    assert inv.position("sync[0]") == Position("inv.yaml", 9, 5)
    assert inv.position("defaults") == Position("inv.yaml", 1, 1)
    flow = loads("{cluster: demo, ssh_config: /dev/null, hosts: [{host: a, workers: 1}]}\n", "inv.yaml")
    assert flow.position("ssh_config") == Position("inv.yaml", 1, 17)


def test_a_missing_ssh_config_is_reported_where_the_inventory_names_it(tmp_path: Path) -> None:
    from dtf.hosts.connections import check_ssh_config

    inv = loads(f"{{cluster: demo, ssh_config: {tmp_path}/nope, hosts: [{{host: a, workers: 1}}]}}\n", "inv.yaml")
    assert inv.ssh_config is not None
    with pytest.raises(InventoryError) as e:
        check_ssh_config(inv.position("ssh_config"), inv.ssh_config)
    assert e.value.lines() == [f"inv.yaml:1:17: ssh_config: {tmp_path}/nope: No such file or directory"]


def test_the_model_is_imported_without_yaml() -> None:
    """What only reads a cluster's record (the plan holds HostSpecs) never loads PyYAML; `load` does."""
    code = ("import sys\nimport dtf.cluster.inventory, dtf.cluster.plan, dtf.cluster.state\n"
            "assert 'yaml' not in sys.modules, 'yaml imported'\n"
            "dtf.cluster.inventory.loads('cluster: c\\nhosts: [{host: a, workers: 1}]\\n')\n"
            "assert 'yaml' in sys.modules\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


def test_a_file_is_read_anew_each_time(tmp_path: Path) -> None:
    path = tmp_path / "inv.yaml"
    path.write_text("cluster: one\nhosts: [{host: a, workers: 1}]\n")
    assert load(path).cluster == "one"
    path.write_text("cluster: two\nhosts: [{host: a, workers: 1}]\n")
    assert load(path).cluster == "two"
