"""Configuration parsing: every bad option fails with a ValueError naming it, before I/O."""

from __future__ import annotations

import logging
import socket
from pathlib import Path

import pytest

import etcd_rdzv
from etcd_rdzv.config.params import (
    ClientConfig,
    Endpoint,
    RendezvousParameters,
    Settings,
    parse_endpoints,
)


def P(endpoint: str = "127.0.0.1:2379", **config: object) -> RendezvousParameters:
    return RendezvousParameters("etcd-rdzv-dynamic", endpoint, "run", 1, 2, **config)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("", [Endpoint("localhost", 2379)]),
        ("etcd1", [Endpoint("etcd1", 2379)]),
        ("etcd1:1234", [Endpoint("etcd1", 1234)]),
        ("a:1, b:2 ,c", [Endpoint("a", 1), Endpoint("b", 2), Endpoint("c", 2379)]),
        ("[::1]", [Endpoint("::1", 2379)]),
        ("[::1]:2380,10.0.0.1:7", [Endpoint("::1", 2380), Endpoint("10.0.0.1", 7)]),
        ("my-host.example.com:65535", [Endpoint("my-host.example.com", 65535)]),
    ],
)
def test_endpoints_parse(text: str, expected: list[Endpoint]) -> None:
    assert list(parse_endpoints(text)) == expected


def test_endpoint_urls_bracket_ipv6() -> None:
    assert Endpoint("::1", 2379).url("https") == "https://[::1]:2379"
    assert Endpoint("h", 1).url("http") == "http://h:1"


@pytest.mark.parametrize(
    ("endpoint", "fragment"),
    [
        ("host:70000", "70000"),
        ("host:0", "out of range"),
        ("host:abc", "'abc'"),
        ("host:", "''"),
        ("a,,b", "empty entry"),
        ("http://host:2379", "scheme"),
        ("::1", "brackets"),
        ("[::1", "closing"),
        ("[nothex]:1", "IPv6"),
        ("[::1]x", "unexpected"),
        ("bad host", "not a valid host"),
        ("a:1,a:1", "twice"),
    ],
)
def test_bad_endpoints(endpoint: str, fragment: str) -> None:
    with pytest.raises(ValueError, match="endpoint") as info:
        ClientConfig.from_params(P(endpoint))
    assert fragment in str(info.value)


@pytest.mark.parametrize(
    ("config", "option", "value"),
    [
        ({"protocol": "ftp"}, "protocol", "ftp"),
        ({"read_timeout": 0}, "read_timeout", "0"),
        ({"read_timeout": -5}, "read_timeout", "-5"),
        ({"read_timeout": "soon"}, "read_timeout", "soon"),
        ({"protocol": "https", "ca_cert": "/nonexistent/ca.pem"}, "ca_cert", "/nonexistent"),
        ({"protocol": "https", "ssl_cert": "/nonexistent/c.pem"}, "ssl_cert", "/nonexistent"),
        ({"ca_cert": __file__}, "ca_cert", "http"),
        ({"username": "root"}, "password", "missing"),
        ({"password": "pw"}, "username", "missing"),
        ({"key_prefix": "relative"}, "key_prefix", "relative"),
        ({"key_prefix": "/a b"}, "key_prefix", "a b"),
        ({"api": "v9"}, "api", "v9"),
        ({"protocol": "https", "tls_insecure": "maybe"}, "tls_insecure", "maybe"),
    ],
)
def test_bad_options_name_option_and_value(
    config: dict[str, object], option: str, value: str
) -> None:
    with pytest.raises(ValueError) as info:
        ClientConfig.from_params(P(**config))
    assert option in str(info.value)
    assert value in str(info.value)


def test_ssl_cert_key_without_cert(tmp_path: object) -> None:
    with pytest.raises(ValueError, match="ssl_cert"):
        ClientConfig.from_params(P(protocol="https", ssl_cert_key=__file__))


def test_good_config_is_normalised() -> None:
    config = ClientConfig.from_params(
        P("a:1,[::1]", protocol=" HTTPS ", read_timeout="7", key_prefix="/x/y/")
    )
    assert config.protocol == "https"
    assert config.read_timeout == 7
    assert config.key_prefix == "/x/y"
    assert config.urls() == ["https://a:1", "https://[::1]:2379"]


@pytest.mark.parametrize(
    ("given", "api"), [(None, "v3"), ("", "v3"), ("v2", "v2"), (" V3 ", "v3"), ("V2", "v2")]
)
def test_api_option(given: str | None, api: str) -> None:
    config = ClientConfig.from_params(P() if given is None else P(api=given))
    assert config.api == api


def test_bad_api_lists_the_supported_ones() -> None:
    with pytest.raises(ValueError, match=r"'api' must be one of v2, v3, got 'v3beta'"):
        ClientConfig.from_params(P(api="v3beta"))


def test_config_remembers_the_run_for_the_one_api_check() -> None:
    assert ClientConfig.from_params(P()).run_id == "run"
    assert ClientConfig.from_params(RendezvousParameters("b", "e:1", "", 1, 1)).run_id is None


def test_build_kv_picks_the_api_without_network(monkeypatch: pytest.MonkeyPatch) -> None:
    from etcd_rdzv._kv.v2.kv import V2KV
    from etcd_rdzv._kv.v3 import V3KV
    from etcd_rdzv.client import build_kv

    def no_network(*args: object, **kwargs: object) -> None:
        raise AssertionError("network I/O attempted while building a client")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    v2 = build_kv(ClientConfig.from_params(P("a:1,b:2", api="v2")))
    v3 = build_kv(ClientConfig.from_params(P("a:1,b:2", username="u", password="p")))
    assert (type(v2), v2.api) == (V2KV, "v2")
    assert (type(v3), v3.api) == (V3KV, "v3")
    assert v3.endpoints == ["http://a:1", "http://b:2"]
    v2.close()
    v3.close()


def test_repr_hides_password() -> None:
    params = P(username="u", password="s3cret")
    assert "s3cret" not in repr(params)
    assert "s3cret" not in repr(ClientConfig.from_params(params))


@pytest.mark.parametrize(
    "bad",
    [
        {"endpoint": "host:70000"},
        {"protocol": "ftp"},
        {"read_timeout": 0},
        {"ca_cert": "/missing.pem", "protocol": "https"},
        {"store_ttl": -1},
    ],
)
def test_bad_config_fails_before_any_network_call(
    bad: dict[str, object], monkeypatch: pytest.MonkeyPatch
) -> None:
    """No socket is opened: the error comes from validation."""

    def no_network(*args: object, **kwargs: object) -> None:
        raise AssertionError("network I/O attempted before validation")

    monkeypatch.setattr(socket, "create_connection", no_network)
    monkeypatch.setattr(socket.socket, "connect", no_network)
    endpoint = str(bad.pop("endpoint", "127.0.0.1:2379"))
    with pytest.raises(ValueError):
        etcd_rdzv.create_backend(P(endpoint, **bad))
    if "store_ttl" not in bad:  # a backend option, not a client one
        with pytest.raises(ValueError):
            etcd_rdzv.create_client(P(endpoint, **bad))


def test_empty_run_id_rejected_before_network() -> None:
    params = RendezvousParameters("etcd-rdzv-dynamic", "127.0.0.1:1", "", 1, 1)
    with pytest.raises(ValueError, match="run id"):
        etcd_rdzv.create_backend(params)


@pytest.mark.parametrize(
    ("value", "expected"), [("yes", True), ("0", False), (1, True), ("False", False), (None, None)]
)
def test_get_as_bool(value: object, expected: bool | None) -> None:
    assert P(flag=value).get_as_bool("flag") is expected


def test_get_as_int_error_names_option() -> None:
    with pytest.raises(ValueError, match="'n'"):
        P(n="x").get_as_int("n")


def test_node_counts_validated() -> None:
    with pytest.raises(ValueError, match="min_nodes"):
        RendezvousParameters("b", "e", "r", 0, 1)
    with pytest.raises(ValueError, match="max_nodes"):
        RendezvousParameters("b", "e", "r", 3, 2)


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("join_timeout", 0),
        ("last_call_timeout", -1),
        ("keep_alive_interval", "soon"),
        ("keep_alive_max_attempt", 0),
        ("store_ttl", -2),
    ],
)
def test_bad_handler_options_fail_before_network(
    option: str, value: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_network(*args: object, **kwargs: object) -> None:
        raise AssertionError("network I/O attempted before validation")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    with pytest.raises(ValueError, match=option) as info:
        etcd_rdzv.create_handler(P(**{option: value}), use_torch=False)
    assert repr(value) in str(info.value)


@pytest.mark.parametrize(
    ("interval", "attempts", "ttl", "every"),
    [
        (None, None, 9, 4.5),  # the defaults: 3 s x 3
        (1, 2, 2, 1.0),  # the fast setting: the interval is already half the TTL
        (5, 3, 15, 7.5),  # torch's defaults
        (2, 1, 2, 2.0),  # one attempt: never less than the interval
    ],
)
def test_a_lease_is_renewed_once_half_its_ttl_has_passed(
    interval: int | None, attempts: int | None, ttl: int, every: float
) -> None:
    given = {"keep_alive_interval": interval, "keep_alive_max_attempt": attempts}
    handler = Settings.from_params(P(**{k: v for k, v in given.items() if v})).handler
    assert (handler.node_ttl, handler.renew_every) == (ttl, every)


def test_settings_parse_every_option_once() -> None:
    settings = Settings.from_params(
        P(read_timeout="7", store_ttl=0, join_timeout=9, heartbeat_timeout=2, api="v3")
    )
    assert (settings.client.read_timeout, settings.client.api) == (7, "v3")
    assert (settings.store_ttl, settings.handler.join_timeout) == (0, 9)
    assert settings.handler.heartbeat_timeout == 2
    assert settings.handler.key_prefix == settings.client.key_prefix
    assert settings.run_id == "run"


def test_unknown_option_is_named_with_the_closest_known_one(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="etcd_rdzv")
    Settings.from_params(P(read_timout=5, frobnicate=1))
    [warning] = [r.getMessage() for r in caplog.records]
    assert "'read_timout' (did you mean 'read_timeout'?)" in warning
    assert "'frobnicate'" in warning


def test_options_torch_puts_into_rdzv_configs_are_not_warned_about(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="etcd_rdzv")
    Settings.from_params(P(timeout=900, is_host=True, join_timeout=10, last_call_timeout=1))
    assert caplog.records == []


def test_rank_given_to_the_native_handler_is_warned_about(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="etcd_rdzv")
    Settings.from_params(P(rank=1))
    assert "etcd-rdzv-static" in caplog.text
    caplog.clear()
    settings = Settings.from_params(P(rank=1), static=True)
    assert caplog.records == []
    assert (settings.handler.rank, settings.handler.rank_source) == (1, "option rank")


def test_the_password_comes_from_the_option_a_file_or_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ETCD_RDZV_PASSWORD", "from-env")
    secret = tmp_path / "pw"
    secret.write_text("from-file\nignored\n")
    assert ClientConfig.from_params(P(username="u", password="given")).password == "given"
    assert ClientConfig.from_params(P(username="u", password_file=str(secret))).password == (
        "from-file"
    )
    assert ClientConfig.from_params(P(username="u")).password == "from-env"
    # without a user the variable is not read (no credentials at all)
    assert ClientConfig.from_params(P()).password is None
    with pytest.raises(ValueError, match="'password' and 'password_file' exclude each other"):
        ClientConfig.from_params(P(username="u", password="p", password_file=str(secret)))
    with pytest.raises(ValueError, match=r"'password_file': file .*nope.* does not exist"):
        ClientConfig.from_params(P(username="u", password_file=str(tmp_path / "nope")))
    secret.write_text("")
    with pytest.raises(ValueError, match="no password on its first line"):
        ClientConfig.from_params(P(username="u", password_file=str(secret)))
    monkeypatch.delenv("ETCD_RDZV_PASSWORD")
    with pytest.raises(ValueError, match=r"'password' is missing .*ETCD_RDZV_PASSWORD"):
        ClientConfig.from_params(P(username="u"))
