"""The etcd-rdzv command line without a server: parsing, help, usage errors, output."""

from __future__ import annotations

import json
import shlex
from typing import Any

import pytest

from etcd_rdzv import RendezvousError, RendezvousResult, _keys, cli
from etcd_rdzv._kv import Record
from etcd_rdzv.cli import _common
from etcd_rdzv.cli.demo import NodeReport, check_demo
from etcd_rdzv.cli.join import export_lines
from etcd_rdzv.cli.status import format_status
from etcd_rdzv.rendezvous.roster import Roster
from etcd_rdzv.runs.status import read_status

COMMANDS = ["demo", "join", "status", "close", "delete", "exclude", "include", "serve"]


@pytest.fixture(autouse=True)
def no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test here must finish before the CLI would talk to etcd or start one."""

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the CLI tried to reach etcd in a unit test")

    monkeypatch.setattr(_common, "handler_from_settings", refuse)
    monkeypatch.setattr(_common, "connect", refuse)
    monkeypatch.delenv(cli.ENV_ENDPOINT, raising=False)
    monkeypatch.delenv(cli.ENV_PASSWORD, raising=False)


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def parse(*argv: str) -> Any:
    return cli.build_parser().parse_args(list(argv))


# -- help --------------------------------------------------------------------------------


def test_top_level_help_lists_the_commands_but_not_the_internal_one(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, _ = run(capsys, "--help")
    assert code == 0
    for command in COMMANDS:
        assert command in out
    assert "_node" not in out


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_has_help(capsys: pytest.CaptureFixture[str], command: str) -> None:
    code, out, err = run(capsys, command, "--help")
    assert code == 0
    assert out.startswith(f"usage: etcd-rdzv {command}")
    assert err == ""


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "--version")
    assert code == 0
    assert out.startswith("etcd-rdzv ")


def test_no_command_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys)
    assert code == 2
    assert "required" in err


# -- parsing -----------------------------------------------------------------------------


def test_join_defaults_are_the_libraries() -> None:
    args = parse("join", "--run-id", "job1", "--min-nodes", "2")
    assert (args.run_id, args.min_nodes, args.max_nodes) == ("job1", 2, None)
    assert not args.export
    assert args.endpoint is None
    # A flag not given leaves the option out: the library's default applies.
    assert (args.join_timeout, args.key_prefix, args.read_timeout) == (None, None, None)
    params, settings = _common.parameters(args, min_nodes=2, max_nodes=2)
    assert params.config == {}
    h, c = settings.handler, settings.client
    assert (h.join_timeout, h.last_call_timeout, h.keep_alive_interval) == (600, 30, 3)
    assert (c.key_prefix, c.protocol, c.read_timeout, c.api) == ("/etcd_rdzv", "http", 60, "v3")
    assert c.max_response_bytes == 64 * 1024 * 1024


def test_demo_defaults() -> None:
    args = parse("demo")
    assert args.nodes == 4
    assert args.min_nodes is None and args.max_nodes is None
    assert (args.join_timeout, args.last_call_timeout, args.keep_alive_interval) == (60, 1, 1)
    assert not args.torch


def test_every_flag_of_an_option_reaches_the_settings() -> None:
    args = parse(
        "join", "--run-id", "r", "--min-nodes", "2", "--close-timeout", "7",
        "--heartbeat-timeout", "2", "--keep-alive-max-attempt", "4", "--node-unit", "2",
        "--max-response-bytes", "65536", "--api", "V2", "--protocol", "HTTPS",
        "--tls-insecure",
    )  # fmt: skip
    _, settings = _common.parameters(args, min_nodes=2, max_nodes=2)
    h, c = settings.handler, settings.client
    assert (h.close_timeout, h.heartbeat_timeout, h.keep_alive_max_attempt) == (7, 2, 4)
    assert (h.node_unit, c.max_response_bytes, c.api) == (2, 65536, "v2")
    assert (c.protocol, c.tls_insecure) == ("https", True)


def test_the_api_variable_is_checked_and_named(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(cli.ENV_API, " V2 ")
    assert _common.parameters(parse("status", "--run-id", "r"))[1].client.api == "v2"
    assert _common.parameters(parse("status", "--run-id", "r", "--api", "v3"))[1].client.api == (
        "v3"
    )
    monkeypatch.setenv(cli.ENV_API, "v4")
    code, _, err = run(capsys, "status", "--run-id", "r")
    assert code == 2
    assert "$ETCD_RDZV_API must be one of v2, v3, got 'v4'" in err


def test_a_static_join_comes_from_the_rank_flag() -> None:
    args = parse("join", "--run-id", "r", "--min-nodes", "2", "--rank", "1")
    params, settings = _common.parameters(args, min_nodes=2, max_nodes=2)
    assert params.backend == "etcd-rdzv-static"
    assert (settings.handler.rank, settings.handler.rank_source) == (1, "option rank")
    params, settings = _common.parameters(parse("join", "--run-id", "r", "--min-nodes", "1"))
    assert (params.backend, settings.handler.rank) == ("etcd-rdzv", None)


def test_demo_nodes_get_every_setting_but_the_password(monkeypatch: pytest.MonkeyPatch) -> None:
    from etcd_rdzv.cli.demo import _node_command

    monkeypatch.setenv(cli.ENV_PASSWORD, "s3cret")
    args = parse("demo", "--username", "u", "--read-timeout", "9", "--close-timeout", "3")
    _, settings = _common.parameters(args, min_nodes=2, max_nodes=3)
    command = _node_command(settings, "127.0.0.1:2379", 0, debug=False, use_torch=False)
    assert "s3cret" not in " ".join(command)
    node = parse(*command[3:])
    _, again = _common.parameters(node, min_nodes=2, max_nodes=3)
    assert again == settings


def test_serve_options() -> None:
    args = parse("serve", "--port", "23790", "--data-dir", "/tmp/x", "--enable-v2")
    assert (args.port, args.data_dir, args.v2) == (23790, "/tmp/x", True)
    assert parse("serve").v2 is False  # v3 only by default, as etcd 3.6


@pytest.mark.parametrize(
    "argv",
    [
        ["--debug", "status", "--run-id", "r"],
        ["status", "--run-id", "r", "--debug"],
    ],
)
def test_global_options_before_or_after_the_command(argv: list[str]) -> None:
    assert parse(*argv).debug is True


def test_endpoint_and_password_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cli.ENV_ENDPOINT, "etcd-a:2379,etcd-b:2379")
    monkeypatch.setenv(cli.ENV_PASSWORD, "s3cret")
    params, settings = _common.parameters(parse("status", "--run-id", "r", "--username", "root"))
    assert params.endpoint == "etcd-a:2379,etcd-b:2379"
    assert params.get("username") == "root"
    # The library reads the variable, as it does for any parameters with a username.
    assert params.get("password") is None
    assert [e.netloc() for e in settings.client.endpoints] == ["etcd-a:2379", "etcd-b:2379"]
    assert (settings.client.username, settings.client.password) == ("root", "s3cret")
    assert "s3cret" not in repr(settings)


def test_flags_beat_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cli.ENV_ENDPOINT, "etcd-a:2379")
    monkeypatch.setenv(cli.ENV_PASSWORD, "from-env")
    args = parse(
        "status", "--run-id", "r", "--endpoint", "[::1]:2380", "--username", "u",
        "--password", "from-flag",
    )  # fmt: skip
    params, settings = _common.parameters(args)
    assert params.endpoint == "[::1]:2380"
    assert params.get("password") == "from-flag"
    assert settings.client.password == "from-flag"


def test_default_endpoint() -> None:
    params, settings = _common.parameters(parse("close", "--run-id", "r"))
    assert params.endpoint == "127.0.0.1:2379"
    assert settings.client.urls() == ["http://127.0.0.1:2379"]


def test_rendezvous_options_reach_the_parameters() -> None:
    args = parse(
        "join", "--run-id", "r", "--min-nodes", "2", "--max-nodes", "3",
        "--join-timeout", "9", "--last-call-timeout", "0", "--key-prefix", "/p/q",
    )  # fmt: skip
    params, settings = _common.parameters(args, min_nodes=2, max_nodes=3)
    assert (params.min_nodes, params.max_nodes) == (2, 3)
    # As typed, like torchrun's --rdzv-conf: the library parses them, once.
    assert params.get("join_timeout") == "9"
    assert params.get("last_call_timeout") == "0"
    assert params.get("key_prefix") == "/p/q"
    assert (settings.handler.min_nodes, settings.handler.max_nodes) == (2, 3)
    assert (settings.handler.join_timeout, settings.handler.last_call_timeout) == (9, 0)
    assert settings.client.key_prefix == "/p/q"


# -- usage errors ------------------------------------------------------------------------

BAD = [
    (["demo", "--nodes", "0"], "--nodes"),
    (["demo", "--nodes", "four"], "--nodes"),
    (["demo", "--nodes", "2", "--min-nodes", "3"], "--min-nodes"),
    (["demo", "--join-timeout", "0"], "--join-timeout"),
    (["join", "--min-nodes", "1"], "--run-id"),
    (["join", "--run-id", "", "--min-nodes", "1"], "--run-id"),
    (["join", "--run-id", "r"], "--min-nodes"),
    (["join", "--run-id", "r", "--min-nodes", "2", "--max-nodes", "1"], "--max-nodes"),
    (["join", "--run-id", "r", "--min-nodes", "1", "--last-call-timeout", "-1"],
     "--last-call-timeout"),
    (["join", "--run-id", "r", "--min-nodes", "1", "--master-port", "0"], "--master-port"),
    (["join", "--run-id", "r", "--min-nodes", "1", "--node-unit", "2"], "--node-unit"),
    (["join", "--run-id", "r", "--min-nodes", "1", "--close-timeout", "x"], "--close-timeout"),
    (["status", "--run-id", "r", "--max-response-bytes", "1024"], "--max-response-bytes"),
    (["status", "--run-id", "r", "--password-file", "/no/such"], "--password-file"),
    (["status", "--run-id", "r", "--api", "v4"], "--api"),
    (["status", "--run-id", "r", "--read-timeout", "0"], "--read-timeout"),
    (["status", "--run-id", "r", "--endpoint", "http://h:2379"], "--endpoint"),
    (["status", "--run-id", "r", "--endpoint", "h:99999"], "--endpoint"),
    (["status", "--run-id", "r", "--endpoint", "a:1,,b:2"], "--endpoint"),
    (["status", "--run-id", "r", "--protocol", "ftp"], "--protocol"),
    (["status", "--run-id", "r", "--key-prefix", "relative"], "--key-prefix"),
    (["close", "--run-id", "r", "--ca-cert", __file__], "--ca-cert"),
    (["close", "--run-id", "r", "--protocol", "https", "--ca-cert", "/no/such.pem"],
     "--ca-cert"),
    (["close", "--run-id", "r", "--protocol", "https", "--ssl-cert-key", __file__],
     "--ssl-cert-key"),
    (["close", "--run-id", "r", "--username", "root"], "--password"),
    (["serve", "--port", "70000"], "--port"),
    (["frobnicate"], "frobnicate"),
]  # fmt: skip


@pytest.mark.parametrize(("argv", "flag"), BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_values_are_usage_errors_naming_the_option(
    capsys: pytest.CaptureFixture[str], argv: list[str], flag: str
) -> None:
    code, out, err = run(capsys, *argv)
    assert code == 2
    assert out == ""
    last = err.strip().splitlines()[-1]
    assert last.startswith("etcd-rdzv")
    assert "error:" in last
    assert flag in last
    assert "Traceback" not in err


def test_a_bad_endpoint_in_the_environment_is_named(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(cli.ENV_ENDPOINT, "https://etcd:2379")
    code, _, err = run(capsys, "status", "--run-id", "r")
    assert code == 2
    assert "$ETCD_RDZV_ENDPOINT" in err


def test_errors_are_one_line_and_tracebacks_need_debug(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def unreachable(*args: Any, **kwargs: Any) -> Any:
        raise RendezvousError("etcd at http://h:1 did not answer\nsecond line")

    monkeypatch.setattr(_common, "connect", unreachable)
    code, out, err = run(capsys, "-q", "status", "--run-id", "r")
    assert (code, out) == (1, "")
    assert err.splitlines() == [
        "etcd-rdzv: error: etcd at http://h:1 did not answer (more with --debug)"
    ]
    code, _, err = run(capsys, "status", "--run-id", "r", "--debug")
    assert code == 1
    assert "Traceback" in err
    assert "second line" in err


# -- output formats ----------------------------------------------------------------------


def _result(addrs: tuple[str, ...], rank: int = 1) -> RendezvousResult:
    members = tuple(f"n{i}" for i in range(len(addrs)))
    return RendezvousResult(rank, len(addrs), None, 3, Roster(members, addrs))  # type: ignore[arg-type]


def test_export_lines_are_shell_assignments() -> None:
    lines = export_lines("job 1", _result(("10.0.0.1", "host b")), master_port=29500)
    assert lines == [
        "export RANK=1",
        "export WORLD_SIZE=2",
        "export MASTER_ADDR=10.0.0.1",
        "export MASTER_PORT=29500",
        "export ETCD_RDZV_ROUND=3",
        "export ETCD_RDZV_RUN_ID='job 1'",
        "export ETCD_RDZV_PEERS='10.0.0.1,host b'",
    ]
    parsed = dict(shlex.split(line)[1].split("=", 1) for line in lines)
    assert parsed["ETCD_RDZV_PEERS"] == "10.0.0.1,host b"


def test_export_lines_without_master_port() -> None:
    lines = export_lines("r", _result(("a",), rank=0))
    assert not any("MASTER_PORT" in line for line in lines)


PREFIX = "/p"
RUN = "job1"
RDZV = _keys.rdzv_dir(PREFIX, RUN)


def _node(round_no: int, node: str, addr: str) -> Record:
    value = json.dumps({"id": node, "addr": addr, "prev_rank": None})
    return Record(_keys.node_key(PREFIX, RUN, round_no, node), value, 10)


def test_status_of_a_run_with_members_and_waiting_nodes() -> None:
    records = [
        Record(RDZV + "/round", "2", 5),
        Record(_keys.result_key(PREFIX, RUN, 1), json.dumps({"members": ["b", "a", "c"]}), 6),
        _node(1, "a", "10.0.0.1"),
        _node(1, "b", "10.0.0.2"),  # c is gone
        _node(2, "d", "10.0.0.4"),
    ]
    status = read_status(records, PREFIX, RUN)
    assert not status.closed
    assert (status.round, status.hint, status.completed_round) == (2, 2, 1)
    assert [(m.rank, m.node, m.addr, m.alive) for m in status.members] == [
        (0, "b", "10.0.0.2", True),
        (1, "a", "10.0.0.1", True),
        (2, "c", None, False),
    ]
    assert [(w.round, w.node, w.addr) for w in status.waiting] == [(2, "d", "10.0.0.4")]
    text = "\n".join(format_status(status))
    assert "closed: no" in text
    assert "round: 2 (forming)" in text
    assert "latest completed round: 1 (world size 3)" in text
    assert "waiting: 1 node(s)" in text
    assert json.loads(json.dumps(status.to_json()))["members"][2]["alive"] is False


def test_status_of_a_closed_run_with_no_completed_round() -> None:
    records = [Record(RDZV + "/closed", "1", 3), _node(1, "a", "h")]
    status = read_status(records, PREFIX, RUN)
    assert status.closed
    assert (status.round, status.completed_round, status.members) == (1, None, ())
    assert [w.node for w in status.waiting] == ["a"]
    assert "closed: yes" in format_status(status)


def test_status_of_an_unknown_run() -> None:
    status = read_status([], PREFIX, RUN)
    assert (status.closed, status.round, status.waiting) == (False, 0, ())
    assert "round: none (no node has joined this run)" in format_status(status)


def test_status_skips_foreign_records() -> None:
    records = [
        Record(RDZV + "/round", "x", 1),
        Record(_keys.result_key(PREFIX, RUN, 1), "not json", 2),
        Record(_keys.node_key(PREFIX, RUN, 1, "z"), json.dumps({"no": "id"}), 3),
    ]
    status = read_status(records, PREFIX, RUN)
    assert len(status.problems) == 3
    assert status.completed_round is None


def test_demo_check_finds_disagreement() -> None:
    good = {"admitted": True, "world_size": 2, "round": 1, "value": "v"}
    reports = [
        NodeReport(0, {**good, "rank": 0}),
        NodeReport(1, {**good, "rank": 0}),
        NodeReport(2, {"admitted": False}),
    ]
    assert check_demo(reports) == ["ranks [0, 0] are not 0..1"]
    reports[1] = NodeReport(1, {**good, "rank": 1})
    assert check_demo(reports) == []


def test_status_shows_spares_of_a_full_group() -> None:
    result = {"members": ["a", "b"], "addrs": ["h", "h"], "as_of": 5, "max_nodes": 2}
    records = [
        Record(_keys.result_key(PREFIX, RUN, 1), json.dumps(result), 6),
        _node(1, "a", "h"),
        _node(1, "b", "h"),
        _node(2, "s", "10.0.0.9"),
    ]
    status = read_status(records, PREFIX, RUN)
    assert [(w.node, w.spare) for w in status.waiting] == [("s", True)]
    assert "1 of them spare(s)" in "\n".join(format_status(status))
    # A member gone: the group is below max_nodes, the node counts as waiting again.
    status = read_status(records[:2] + records[3:], PREFIX, RUN)
    assert [(w.node, w.spare) for w in status.waiting] == [("s", False)]


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["exclude", "--host", "a b"], "--host: 'a b' is not a host id"),
        (["exclude", "--host", "h", "--for", "0"], "--for: '0' is not a duration"),
        (["exclude", "--host", "h", "--for", "3w"], "--for: '3w' is not a duration"),
        (["exclude", "--host", "h", "--reason", "x" * 513], "--reason: at most 512"),
        (["include", "--host", "a/b"], "--host: 'a/b' is not a host id"),
    ],
)
def test_exclude_and_include_refuse_bad_values_before_any_request(
    capsys: pytest.CaptureFixture[str], argv: list[str], named: str
) -> None:
    code, _, err = run(capsys, argv[0], "--run-id", "r", *argv[1:])
    assert code == 2 and named in err, err


def test_durations_of_exclude() -> None:
    from etcd_rdzv.cli.hosts import duration

    assert [duration(t) for t in ("90", "90s", "30m", "12h", "2d")] == [
        90,
        90,
        1800,
        43200,
        172800,
    ]


# -- typos: "did you mean", and the usage of the command they were given to -------------


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (
            ["status", "--run-id", "j", "--jsno"],
            "unrecognized arguments: --jsno (did you mean --json?)",
        ),
        (["status", "--run_id=j"], "--run_id=j (did you mean --run-id?)"),
        # The mistyped flag is why a required one is missing: both are said.
        (
            ["exclude", "--run-id", "j", "--hots", "gpu-07"],
            "--hots (did you mean --host?); the following arguments are required: --host",
        ),
        (["close", "--run-id", "j", "--endpont", "h:1"], "--endpont (did you mean --endpoint?)"),
    ],
)
def test_a_mistyped_flag_gets_did_you_mean_and_the_commands_usage(
    capsys: pytest.CaptureFixture[str], argv: list[str], said: str
) -> None:
    code, out, err = run(capsys, *argv)
    assert code == 2
    assert out == ""
    assert err.startswith(f"usage: etcd-rdzv {argv[0]} "), err
    assert f"etcd-rdzv {argv[0]}: error: " in err
    assert said in err, err


def test_a_mistyped_command_gets_did_you_mean(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "stauts", "--run-id", "j")
    assert code == 2
    assert "invalid choice: 'stauts'" in err and "(did you mean 'status'?)" in err


def test_an_unknown_flag_with_nothing_close_is_named_alone(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, _, err = run(capsys, "status", "--run-id", "j", "--zzzzzzzz", "x")
    assert code == 2
    assert err.startswith("usage: etcd-rdzv status ")
    assert "unrecognized arguments: --zzzzzzzz, x\n" in err
    # An unambiguous prefix is still taken, as argparse does.
    args = parse("status", "--run", "j", "--js")
    assert (args.run_id, args.json) == ("j", True)


def test_a_gone_member_keeps_the_address_and_host_its_result_records() -> None:
    result = {
        "members": ["a", "b"],
        "addrs": ["10.0.0.1", "10.0.0.2"],
        "hosts": ["host-a", "host-b"],
        "as_of": 5,
        "max_nodes": 2,
    }
    records = [Record(_keys.result_key(PREFIX, RUN, 1), json.dumps(result), 6), _node(1, "a", "x")]
    status = read_status(records, PREFIX, RUN)
    assert [(m.addr, m.host, m.alive) for m in status.members] == [
        ("x", None, True),  # alive: as its join key says
        ("10.0.0.2", "host-b", False),  # gone: as the result recorded it
    ]
    lines = format_status(status)
    assert any(line.split() == ["1", "b", "10.0.0.2", "no", "host-b"] for line in lines), lines


@pytest.mark.parametrize("hosts", [["host-a"], ["a b", "host-b"], "host-a", [1, 2]])
def test_a_result_whose_hosts_are_not_host_ids_is_refused(hosts: object) -> None:
    result = {"members": ["a", "b"], "addrs": ["h", "h"], "hosts": hosts, "as_of": 5}
    status = read_status(
        [Record(_keys.result_key(PREFIX, RUN, 1), json.dumps(result), 6)], PREFIX, RUN
    )
    assert status.completed_round is None
    assert len(status.problems) == 1 and "hosts" in status.problems[0]


def test_exclusion_durations_are_shown_as_given_and_their_ends_in_two_units() -> None:
    from etcd_rdzv.cli.status import human, time_left

    assert [human(s) for s in (90, 1800, 43200, 172800, 3601)] == [
        "90s",
        "30m",
        "12h",
        "2d",
        "3601s",
    ]
    assert [time_left(s) for s in (0, 42, 250, 43199, 43200, 90000)] == [
        "0s",
        "42s",
        "4m 10s",
        "11h 59m",
        "12h 0m",
        "1d 1h",
    ]


def test_every_flag_of_the_synopses_in_docs_cli_md_is_a_flag_of_its_command() -> None:
    import argparse
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "cli.md").read_text()
    synopses = re.findall(r"^```\n(etcd-rdzv [a-z]+ .*?)^```$", text, re.M | re.S)
    assert len(synopses) >= 7, synopses
    parser = cli.build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for synopsis in synopses:
        command = synopsis.split()[1]
        known = commands.choices[command]._option_string_actions
        for flag in re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", synopsis):
            assert flag in known, f"docs/cli.md: {command} has no {flag}"
