"""The option table: each option declared once, and what is made from it (the parsing,
the unknown-option check, the command line's flags, the documentation's tables)."""

from __future__ import annotations

import dataclasses
import logging
import socket
import typing
from pathlib import Path
from typing import Any

import pytest

import etcd_rdzv
from etcd_rdzv import cli
from etcd_rdzv.config import _options, params
from etcd_rdzv.config import docs as _option_docs
from etcd_rdzv.config.params import ClientConfig, HandlerSettings, RendezvousParameters, Settings

DOCS = Path(__file__).resolve().parents[2] / "docs"
INTS = [o for o in _options.OPTIONS if o.kind in ("int", "number") and o.minimum is not None]


def P(**config: object) -> RendezvousParameters:
    return RendezvousParameters("etcd-rdzv", "127.0.0.1:2379", "run", 1, 2, **config)


@pytest.mark.parametrize("name", sorted(_option_docs.BLOCKS))
def test_the_documentation_holds_the_table_made_from_the_declarations(name: str) -> None:
    document = (DOCS / name).read_text(encoding="utf-8")
    made = _option_docs.replace_block(document, _option_docs.BLOCKS[name]())
    assert document == made, (
        f"docs/{name} is not what the option table makes: run "
        "python3 -m etcd_rdzv.config.docs --write"
    )


def test_every_declared_option_is_documented_and_known() -> None:
    table = _option_docs.configuration_table()
    names = [o.name for o in _options.OPTIONS]
    assert len(names) == len(set(names))
    for name in names:
        assert f"| `{name}` |" in table
        assert name in params.KNOWN_OPTIONS


def test_the_defaults_of_the_settings_are_the_declared_ones() -> None:
    settings = Settings.from_params(P())
    for opt in _options.OPTIONS:
        if opt.name not in ("password_file", "rank", "host_id"):
            assert settings.value(opt.name) == opt.default, opt.name
    # host_id has no fixed default: this machine's host name (or local_addr's host).
    assert settings.value("host_id") == socket.gethostname()
    assert _options.option("store_ttl").default == params.DEFAULT_STORE_TTL
    assert _options.option("key_prefix").default == params.DEFAULT_KEY_PREFIX


#: Each settings object, the readers whose options it holds, and its fields that are
#: not options (the parameters' own arguments, and what a rule derives).
HOLDERS: list[tuple[type[Any], tuple[_options.Reader, ...], set[str]]] = [
    (ClientConfig, ("client",), {"endpoints", "run_id"}),
    (Settings, ("store",), {"client", "handler", "backend", "local_addr"}),
    (
        HandlerSettings,
        ("handler", "native", "static"),
        {"run_id", "min_nodes", "max_nodes", "key_prefix", "rank_source"},
    ),
]
_TYPES = {"int": int, "number": float, "bool": bool, "choice": str, "text": str, "file": str}


@pytest.mark.parametrize(
    ("holder", "readers", "not_options"), HOLDERS, ids=[h[0].__name__ for h in HOLDERS]
)
def test_the_settings_fields_are_the_declared_options(
    holder: type[Any], readers: tuple[_options.Reader, ...], not_options: set[str]
) -> None:
    """The fields stay written out for the type checker: this keeps them equal to the
    table, both ways, with the declared kind and default."""
    declared = {o.name: o for o in _options.read_by(*readers) if o.field}
    fields = {f.name: f for f in dataclasses.fields(holder)}
    options = set(fields) - not_options
    assert options - set(declared) == set(), (
        f"{holder.__name__} has fields no option of {readers} declares: declare them in "
        "etcd_rdzv/config/_options.py (or they are not options)"
    )
    assert set(declared) - options == set(), (
        f"options of {readers} that {holder.__name__} has no field for: add the fields"
    )
    hints = typing.get_type_hints(holder)
    for name, opt in declared.items():
        kinds = set(typing.get_args(hints[name])) or {hints[name]}
        assert kinds - {type(None)} == {_TYPES[opt.kind]}, (name, hints[name])
        default = fields[name].default
        if opt.default is not None or type(None) in kinds:
            assert default == opt.default, (name, default, opt.default)
        # else a rule always gives it a value (host_id: the host name).
    # Every reader's options are held by one of the settings objects.
    assert {o.reader for o in _options.OPTIONS} <= {r for _, rs, _ in HOLDERS for r in rs}


#: A valid value other than the default for the options whose kind does not make one.
_GIVEN: dict[str, object] = {
    "username": "user",
    "password": "secret",
    "key_prefix": "/other_prefix",
    "node_group": "rack-7",
    "host_id": "gpu-07",
    "health_check": "true",
}


def _given(opt: _options.Option, tmp: Path) -> object:
    """A valid value of ``opt`` that is not its default, from its declaration."""
    if opt.kind == "int":
        return str((opt.default or opt.minimum or 0) + 1)
    if opt.kind == "number":
        return str((opt.default or opt.minimum or 0) + 0.5)
    if opt.kind == "bool":
        return "false" if opt.default else "true"
    if opt.kind == "choice":
        return next(c.upper() for c in opt.choices if c != opt.default)
    if opt.kind == "file":
        path = tmp / opt.name
        path.write_text("secret\n")
        return str(path)
    return _GIVEN[opt.name]


def test_every_declared_option_given_reaches_its_settings_field(tmp_path: Path) -> None:
    """The settings read every option of the table: one given in the parameters is
    in its field (no list of names to keep beside the table)."""
    given = {o.name: _given(o, tmp_path) for o in _options.OPTIONS}
    del given["password"]  # it excludes password_file; checked below
    static = RendezvousParameters("etcd-rdzv-static", "h:1", "run", 4, 4, **given)
    native = RendezvousParameters("etcd-rdzv", "h:1", "run", 1, 4, **given)
    for flavour, settings in (
        ("static", Settings.from_params(static)),
        ("native", Settings.from_params(native)),
    ):
        for opt in _options.OPTIONS:
            raw = given.get(opt.name)
            if not opt.field or raw is None:
                continue
            if flavour == "static" and opt.name in ("node_group", "node_unit"):
                continue  # the static handler's world is given: these are ignored
            if flavour == "native" and opt.name == "rank":
                continue  # only the static handler reads it
            expected = opt.parse(raw)
            assert expected != opt.default, opt.name
            assert settings.value(opt.name) == expected, (flavour, opt.name)
    # password_file has no field: its first line is the password.
    assert Settings.from_params(native).client.password == "secret"
    assert Settings.from_params(native).value("password_file") is None
    assert Settings.from_params(P(username="u", password="pw")).value("password") == "pw"


@pytest.mark.parametrize("opt", INTS, ids=[o.name for o in INTS])
def test_integer_options_hold_their_bounds(opt: _options.Option) -> None:
    minimum = opt.minimum or 0
    assert opt.parse(str(minimum)) == minimum
    with pytest.raises(ValueError) as info:
        opt.parse(minimum - 1)
    assert repr(opt.name) in str(info.value)
    assert repr(minimum - 1) in str(info.value)


def test_max_response_bytes_is_a_client_option() -> None:
    assert ClientConfig.from_params(P()).max_response_bytes == 64 * 1024 * 1024
    assert ClientConfig.from_params(P(max_response_bytes="65536")).max_response_bytes == 65536
    with pytest.raises(
        ValueError, match=r"'max_response_bytes' must be an integer >= 65536 \(bytes\), got 1024"
    ):
        ClientConfig.from_params(P(max_response_bytes=1024))
    with pytest.raises(ValueError, match="'max_response_bytes' must be an integer, got 'big'"):
        Settings.from_params(P(max_response_bytes="big"))


def test_create_client_warns_about_unknown_options(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    built: list[ClientConfig] = []
    monkeypatch.setattr(etcd_rdzv.client._connect, "connect", built.append)
    caplog.set_level(logging.WARNING, logger="etcd_rdzv")
    etcd_rdzv.create_client(P(max_response_byte=1 << 20, join_timeout=5))
    assert len(built) == 1
    [warning] = [r.getMessage() for r in caplog.records]
    assert "'max_response_byte' (did you mean 'max_response_bytes'?)" in warning
    assert "join_timeout" not in warning  # known: the handler reads it


def test_settings_warn_once_about_an_unknown_option(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="etcd_rdzv")
    Settings.from_params(P(keep_alive_intervall=5))
    assert len(caplog.records) == 1
    assert "did you mean 'keep_alive_interval'?" in caplog.text


def _help(*argv: str) -> str:
    parser = cli.build_parser()
    for action in parser._subparsers._group_actions:  # type: ignore[union-attr]
        sub: Any = action.choices[argv[0]]  # type: ignore[index]
        return str(sub.format_help())
    raise AssertionError("no subcommands")


@pytest.mark.parametrize(
    ("command", "groups"),
    [
        ("join", ("etcd", "rendezvous", "join")),
        ("demo", ("etcd", "rendezvous")),
        ("status", ("etcd",)),
        ("close", ("etcd",)),
        ("delete", ("etcd",)),
    ],
)
def test_commands_have_a_flag_for_each_option_of_their_groups(
    command: str, groups: tuple[str, ...]
) -> None:
    text = _help(command)
    for opt in _options.OPTIONS:
        if opt.cli in groups:
            assert f"{opt.flag} " in text or f"{opt.flag}\n" in text, (command, opt.flag)
        elif opt.cli is not None and command != "delete":
            assert opt.flag not in text, (command, opt.flag)


def test_help_names_flags_and_the_declared_defaults() -> None:
    text = " ".join(_help("join").split())
    assert "private key of --ssl-cert" in text
    assert "(default: $ETCD_RDZV_API, else v3)" in text
    assert "(default: 600)" in text
    assert "`" not in text
    demo = " ".join(_help("demo").split())
    assert "(default: 60)" in demo and "(default: 600)" not in demo


@pytest.mark.parametrize(
    ("name", "raw", "expected"),
    [
        ("api", "", "v3"),
        ("api", " V2 ", "v2"),
        ("username", "", None),
        ("ca_cert", "", None),
        ("read_timeout", None, 60),
        ("tls_insecure", "yes", True),
    ],
)
def test_what_a_blank_or_missing_value_means(name: str, raw: object, expected: object) -> None:
    assert _options.option(name).parse(raw) == expected


@pytest.mark.parametrize("name", ["protocol", "key_prefix", "read_timeout", "tls_insecure"])
def test_a_blank_value_is_an_error_where_there_is_no_blank_default(name: str) -> None:
    with pytest.raises(ValueError, match=repr(name)):
        _options.option(name).parse("")


@pytest.mark.parametrize(
    ("config", "local_addr", "env", "expected"),
    [
        ({"host_id": "gpu-07"}, "10.0.0.1", {"ETCD_RDZV_HOST_ID": "other"}, "gpu-07"),
        ({}, "10.0.0.1", {"ETCD_RDZV_HOST_ID": "from-env"}, "from-env"),
        ({}, "node-3.cluster:29500", {}, "node-3.cluster"),
        ({}, "[fd00::7]:29500", {}, "fd00::7"),
        ({}, "fd00::7", {}, "fd00::7"),
        ({}, None, {}, socket.gethostname()),
    ],
)
def test_a_nodes_host_id(
    config: dict[str, object],
    local_addr: str | None,
    env: dict[str, str],
    expected: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("ETCD_RDZV_HOST_ID", raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    given = RendezvousParameters("etcd-rdzv", "h:1", "run", 1, 2, local_addr, **config)
    assert Settings.from_params(given).handler.host_id == expected


@pytest.mark.parametrize("bad", ["two words", "a/b", "x" * 254, "tab\t", "ünï"])
def test_a_bad_host_id_is_refused_naming_the_option(
    bad: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("ETCD_RDZV_HOST_ID", raising=False)
    with pytest.raises(ValueError, match="Option 'host_id' must be"):
        Settings.from_params(P(host_id=bad))
    monkeypatch.setenv("ETCD_RDZV_HOST_ID", bad)
    with pytest.raises(ValueError, match="Environment variable ETCD_RDZV_HOST_ID must be"):
        Settings.from_params(P())


def test_torchs_dynamic_handler_warns_about_each_option_only_ours_read(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The table's ``native`` options, given to torch's dynamic handler, are named in
    one WARNING; the options every handler reads are not."""
    handlers = _options.read_by("handler", "native")
    given = {o.name: _given(o, tmp_path) for o in handlers}
    dynamic = RendezvousParameters("etcd-rdzv-dynamic", "h:1", "run", 1, 4, **given)
    with caplog.at_level(logging.WARNING, logger="etcd_rdzv.config.params"):
        Settings.from_params(dynamic)
    [warning] = [r.getMessage() for r in caplog.records]
    assert "torch's dynamic handler ignores them" in warning
    for opt in handlers:
        assert (repr(opt.name) in warning) == (opt.reader == "native"), opt.name


@pytest.mark.parametrize(
    ("given", "value"), [("0.3", 0.3), (0.25, 0.25), (2, 2.0), (" 1.5 ", 1.5), ("0", 0.0)]
)
def test_rejoin_grace_takes_fractions_of_a_second(given: object, value: float) -> None:
    assert Settings.from_params(P(rejoin_grace=given)).handler.rejoin_grace == value


@pytest.mark.parametrize("given", ["-0.1", "nan", "inf", "soon", True, "", [1]])
def test_rejoin_grace_refuses_what_is_not_a_non_negative_number(given: object) -> None:
    with pytest.raises(ValueError, match=r"'rejoin_grace' must be a"):
        Settings.from_params(P(rejoin_grace=given))
