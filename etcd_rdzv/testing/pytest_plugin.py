"""pytest fixtures for a real etcd. Enable with::

    pytest_plugins = ["etcd_rdzv.testing.pytest_plugin"]

Fixtures:

* ``etcd_server`` (session): one member with the v2 API, on free loopback ports.
* ``etcd_key_prefix``: a fresh etcd key prefix per test, so tests never share keys.
* ``etcd_params``: a factory ``etcd_params(run_id="...", **options)`` of rendezvous
  parameters for ``etcd_server`` under ``etcd_key_prefix``.
* ``etcd_server_v3`` (session): one member *without* the v2 API (v3 only).
* ``etcd_server_v3_34`` (session): one v3-only member of Debian's etcd 3.4
  (``/usr/bin/etcd``, package ``etcd-server``). Skipped when that binary is missing,
  a failure when ``ETCD_RDZV_REQUIRE_DEBIAN_ETCD=1`` (or ``ETCD_RDZV_NO_SKIP=1``).
* ``etcd_variant``: the etcd a test runs on, one of :data:`ETCD_VARIANTS`: ``"v2"``
  (``etcd_server``), ``"v3"`` (``etcd_server_v3``), ``"v3-3.4"``
  (``etcd_server_v3_34``). A test that uses it, or any fixture below, runs once per
  variant: ``v2`` and ``v3`` unless marked, e.g.
  ``@pytest.mark.etcd_variants("v2", "v3", "v3-3.4")`` (on a test, class or module).
* ``etcd_api``: the API of ``etcd_variant``: ``"v2"`` or ``"v3"``.
* ``etcd_api_server``: the member of ``etcd_variant``.
* ``etcd_api_params``: like ``etcd_params``, for ``etcd_api_server``, with the ``api``
  option set.
* ``etcd_rdzv_cli``: the ``etcd-rdzv`` command line in subprocesses
  (:class:`EtcdRdzvCli`: ``run(*args)``, ``start(*args)`` (a :class:`CliProcess`),
  ``status(run_id, *options)``, ``until(condition)``); what it started and still runs
  is stopped after the test (SIGTERM, then SIGKILL).

:func:`variant_server_options` gives the ``EtcdServer``/``EtcdCluster`` arguments of a
variant, for tests that start members of their own (TLS, clusters).

``ETCD_RDZV_NO_SKIP=1`` turns every skip into a failure naming the skip's reason (CI
sets it), and every expected failure but a declared one (:func:`known_difference`, a
strict xfail that failed as declared); :func:`skip_or_fail` is the skip for a missing
prerequisite that honours it.

When a test fails, the last lines of every running member's log are added to the
report.
"""

from __future__ import annotations

import re
import subprocess
import uuid
from collections.abc import Callable, Generator, Iterator
from os import X_OK, access, environ
from os.path import isfile
from typing import Any, NoReturn

import pytest

from ..config.params import RendezvousParameters
from ._cli_runner import EtcdRdzvCli
from ._server import EtcdServer, running_servers

#: Every etcd variant: the API and which etcd serves it.
ETCD_VARIANTS = ("v2", "v3", "v3-3.4")
#: The variants a test runs on unless marked with ``etcd_variants``.
DEFAULT_VARIANTS = ("v2", "v3")
#: Debian's etcd (package ``etcd-server``, 3.4), the ``v3-3.4`` variant.
DEBIAN_ETCD = "/usr/bin/etcd"
REQUIRE_DEBIAN_ETCD_ENV = "ETCD_RDZV_REQUIRE_DEBIAN_ETCD"

_debian_etcd: dict[str, str] = {}  # the checked binary, or why it cannot be used


def variant_api(variant: str) -> str:
    """The API (``"v2"`` or ``"v3"``) of ``variant``.

    Raises:
        ValueError: not one of :data:`ETCD_VARIANTS`.
    """
    if variant not in ETCD_VARIANTS:
        raise ValueError(f"Unknown etcd variant {variant!r}; known: {', '.join(ETCD_VARIANTS)}.")
    return variant.split("-", 1)[0]


def debian_etcd_binary() -> str:
    """Debian's etcd 3.4 binary, checked once per session.

    Skips the calling test when it is missing (or not 3.4); fails it instead when
    ``ETCD_RDZV_REQUIRE_DEBIAN_ETCD=1`` or ``ETCD_RDZV_NO_SKIP=1``, as in CI.
    """
    if not _debian_etcd:
        _debian_etcd.update(_check_debian_etcd())
    if "binary" in _debian_etcd:
        return _debian_etcd["binary"]
    skip_or_fail(_debian_etcd["reason"], require=REQUIRE_DEBIAN_ETCD_ENV)


def _check_debian_etcd() -> dict[str, str]:
    if not (isfile(DEBIAN_ETCD) and access(DEBIAN_ETCD, X_OK)):
        return {"reason": f"{DEBIAN_ETCD} is missing: apt-get install etcd-server (etcd 3.4)"}
    try:
        out = subprocess.run(
            [DEBIAN_ETCD, "--version"], capture_output=True, text=True, timeout=30, check=False
        ).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        return {"reason": f"{DEBIAN_ETCD} --version failed: {exc}"}
    match = re.search(r"etcd Version: (\S+)", out)
    if not match or not match.group(1).startswith("3.4."):
        return {"reason": f"{DEBIAN_ETCD} is not etcd 3.4 ({out.strip()[:80]!r})"}
    return {"binary": DEBIAN_ETCD}


def variant_server_options(variant: str) -> dict[str, Any]:
    """``EtcdServer`` / ``EtcdCluster`` keyword arguments of ``variant``
    (``enable_v2``, ``binary``); skips (or fails) as :func:`debian_etcd_binary`."""
    api = variant_api(variant)
    binary = debian_etcd_binary() if variant == "v3-3.4" else None
    return {"enable_v2": api == "v2", "binary": binary}


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "etcd_variants(*names): the etcd variants (v2, v3, v3-3.4) a test using "
        "etcd_variant / etcd_api / etcd_api_params runs on (default: v2, v3)",
    )


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "etcd_variant" not in metafunc.fixturenames:
        return
    for mark in metafunc.definition.iter_markers("parametrize"):
        names = mark.args[0] if mark.args else mark.kwargs.get("argnames", "")
        if isinstance(names, str):
            names = [n.strip() for n in names.split(",")]
        if {"etcd_variant", "etcd_api"} & set(names):
            return  # the test chose its own values
    marker = metafunc.definition.get_closest_marker("etcd_variants")
    variants = tuple(marker.args) if marker else DEFAULT_VARIANTS
    for variant in variants:
        variant_api(variant)  # an unknown name fails at collection
    metafunc.parametrize("etcd_variant", variants, indirect=True, ids=list(variants))


@pytest.fixture(scope="session")
def etcd_server() -> Iterator[EtcdServer]:
    """One etcd member (v2 API on) for the whole session."""
    with EtcdServer("session") as server:
        yield server


@pytest.fixture(scope="session")
def etcd_server_v3() -> Iterator[EtcdServer]:
    """One etcd member without the v2 API for the whole session."""
    with EtcdServer("session-v3", enable_v2=False) as server:
        yield server


@pytest.fixture(scope="session")
def etcd_server_v3_34() -> Iterator[EtcdServer]:
    """One member of Debian's etcd 3.4 without the v2 API for the whole session."""
    with EtcdServer("session-v3-34", enable_v2=False, binary=debian_etcd_binary()) as server:
        yield server


@pytest.fixture
def etcd_variant(request: pytest.FixtureRequest) -> str:
    """The etcd variant a test runs on (see the module docstring)."""
    return str(getattr(request, "param", "v2"))


@pytest.fixture
def etcd_api(etcd_variant: str) -> str:
    """The etcd API a test runs on: ``"v2"`` or ``"v3"``."""
    return variant_api(etcd_variant)


_SERVER_OF = {"v2": "etcd_server", "v3": "etcd_server_v3", "v3-3.4": "etcd_server_v3_34"}


@pytest.fixture
def etcd_api_server(request: pytest.FixtureRequest, etcd_variant: str, etcd_api: str) -> EtcdServer:
    """The session member of ``etcd_variant``."""
    # A test that parametrises etcd_api itself gets that API's default member.
    variant = etcd_variant if variant_api(etcd_variant) == etcd_api else etcd_api
    server: EtcdServer = request.getfixturevalue(_SERVER_OF[variant])
    return server


@pytest.fixture
def etcd_api_params(
    etcd_api_server: EtcdServer, etcd_api: str, etcd_key_prefix: str
) -> Callable[..., RendezvousParameters]:
    """Factory of parameters for ``etcd_api_server``, with ``api`` set, under a fresh prefix."""

    def make(run_id: str = "run", **config: Any) -> RendezvousParameters:
        config.setdefault("key_prefix", etcd_key_prefix)
        config.setdefault("api", etcd_api)
        return etcd_api_server.params(run_id, **config)

    return make


@pytest.fixture
def etcd_key_prefix(request: pytest.FixtureRequest) -> str:
    """A key prefix no other test uses."""
    name = re.sub(r"[^A-Za-z0-9_-]", "_", request.node.name)[:40]
    return f"/etcd_rdzv_test/{name}-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def etcd_params(
    etcd_server: EtcdServer, etcd_key_prefix: str
) -> Callable[..., RendezvousParameters]:
    """Factory of parameters for ``etcd_server`` under a fresh prefix."""

    def make(run_id: str = "run", **config: Any) -> RendezvousParameters:
        config.setdefault("key_prefix", etcd_key_prefix)
        return etcd_server.params(run_id, **config)

    return make


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, Any, None]:
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        for server in running_servers():
            report.sections.append(
                (f"etcd log: {server.name} ({server.client_url})", server.log_tail(60))
            )
    _fail_an_undeclared_xfail(item, call, report)
    _fail_a_skip(report)


# -- no skips -----------------------------------------------------------------------------
#
# A skipped test looks like a passed one in a green run. Where every prerequisite is
# meant to be installed (CI), ETCD_RDZV_NO_SKIP=1 turns every skip (pytest.skip(), the
# skip and skipif markers, importorskip, a skip at collection) into a failure that
# carries the skip's reason. An expected failure (xfail) passes there only if it is a
# known difference: its mark came from known_difference() (strict, declared in the one
# registry of a suite's known differences). Any other xfail (a hand-written mark,
# pytest.xfail() in a test) and any XPASS is a failure as well: a test that is expected
# to fail proves nothing unless someone declared why.

NO_SKIP_ENV = "ETCD_RDZV_NO_SKIP"


def no_skip() -> bool:
    """Whether ``ETCD_RDZV_NO_SKIP=1``: every skip is a failure."""
    return environ.get(NO_SKIP_ENV) == "1"


def skip_or_fail(reason: str, *, require: str | None = None) -> NoReturn:
    """Skip the calling test because ``reason`` (a missing prerequisite); fail it instead
    when ``ETCD_RDZV_NO_SKIP=1``, or when the environment variable ``require`` is ``1``.

    Raises:
        pytest.fail.Exception: a skip is not allowed here.
        pytest.skip.Exception: otherwise.
    """
    for name in (require, NO_SKIP_ENV):
        if name is not None and environ.get(name) == "1":
            pytest.fail(f"{name}=1 but {reason}", pytrace=False)
    pytest.skip(reason)


#: The marks known_difference() made: the only expected failures ETCD_RDZV_NO_SKIP=1 lets by.
_KNOWN_DIFFERENCES: list[pytest.Mark] = []


def known_difference(
    reason: str, *, raises: type[BaseException] | tuple[type[BaseException], ...] | None = None
) -> pytest.MarkDecorator:
    """The mark of a test that fails on purpose: a strict xfail (a pass fails the test)
    that ``ETCD_RDZV_NO_SKIP=1`` accepts. Every other xfail fails there. A suite calls it
    from the one place that lists its known differences, with the reason each exists.

    Args:
        reason: why the test fails, shown in the report.
        raises: the error(s) the failure must raise; any other error fails the test.

    Raises:
        ValueError: ``reason`` is empty.
    """
    if not reason.strip():
        raise ValueError("known_difference() needs a reason: say why the test fails.")
    mark = pytest.mark.xfail(strict=True, reason=reason, raises=raises)
    if mark.mark not in _KNOWN_DIFFERENCES:
        _KNOWN_DIFFERENCES.append(mark.mark)
    return mark


def _fail_an_undeclared_xfail(
    item: pytest.Item, call: pytest.CallInfo[None], report: pytest.TestReport
) -> None:
    if not (no_skip() and hasattr(report, "wasxfail")):
        return
    reason = report.wasxfail
    called = call.excinfo is not None and isinstance(call.excinfo.value, pytest.xfail.Exception)
    declared = not called and any(m in _KNOWN_DIFFERENCES for m in item.iter_markers("xfail"))
    if report.passed:
        why = f"this expected failure passed (XPASS: {reason}); a difference that went away"
    elif not declared:
        why = (
            f"this expected failure is not a known difference ({reason}); mark it with "
            "etcd_rdzv.testing.pytest_plugin.known_difference() where the suite lists them"
        )
    else:
        return
    del report.wasxfail
    report.outcome = "failed"
    report.longrepr = f"{NO_SKIP_ENV}=1 lets only declared, failing known differences by: {why}"


def _skip_reason(longrepr: object) -> str:
    # A skip's longrepr is (path, line, "Skipped: reason").
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2])
    return str(longrepr)


def _fail_a_skip(report: pytest.TestReport | pytest.CollectReport) -> None:
    if not (report.skipped and no_skip()) or hasattr(report, "wasxfail"):
        return
    report.outcome = "failed"
    report.longrepr = (
        f"{NO_SKIP_ENV}=1 makes every skip a failure; this one skipped: "
        f"{_skip_reason(report.longrepr)}"
    )


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Generator[None, Any, None]:
    outcome = yield
    _fail_a_skip(outcome.get_result())


# -- the etcd-rdzv command line ---------------------------------------------------------
#
# ``etcd_rdzv_cli`` runs the command line as users run it (``python -m etcd_rdzv``, in a
# subprocess of this interpreter, importing this etcd_rdzv), every call bounded by a
# timeout, and stops what a test started when it ends.


#: Environment variables of the test harness that a CLI subprocess keeps; every other
#: ``ETCD_RDZV_*`` variable (the CLI reads its options from them) is removed.
@pytest.fixture
def etcd_rdzv_cli() -> Iterator[EtcdRdzvCli]:
    """The ``etcd-rdzv`` command line in subprocesses (``run``, ``start``, ``status``,
    ``until``); what a test started is stopped when it ends (:meth:`EtcdRdzvCli.close`)."""
    cli = EtcdRdzvCli()
    try:
        yield cli
    finally:
        cli.close()


# -- etcd in Docker containers ----------------------------------------------------------
#
# ``etcd_container_image`` (session) checks once that a Docker engine answers and that
# the image ($ETCD_RDZV_IMAGE, else the official one) is there or can be pulled. If not,
# every container test is skipped with a reason that says how to enable it, or fails
# when ETCD_RDZV_REQUIRE_DOCKER=1 (CI). docker and testcontainers are imported only
# when one of these fixtures runs. The section keeps its own imports, here.

from ._containers import EtcdContainer, EtcdContainerCluster  # noqa: E402

REQUIRE_DOCKER_ENV = "ETCD_RDZV_REQUIRE_DOCKER"
_HOW_TO_ENABLE = (
    "To enable: start a Docker engine, and build the etcd image where none can be "
    'pulled: `eval "$(python3 -m etcd_rdzv.testing.image --export)"` (sets '
    "ETCD_RDZV_IMAGE). With ETCD_RDZV_REQUIRE_DOCKER=1 this is a failure, not a skip."
)


class _ContainerLogReport:
    """Adds the log tail of every live etcd container to a failed test's report."""

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(
        self, item: pytest.Item, call: pytest.CallInfo[None]
    ) -> Generator[None, Any, None]:
        from ._containers import running_containers

        outcome = yield
        report = outcome.get_result()
        if report.failed:
            for member in running_containers():
                report.sections.append(
                    (
                        f"etcd container log: {member.container_name} ({member.client_url})",
                        member.log_tail(60),
                    )
                )


@pytest.fixture(scope="session")
def etcd_container_image(request: pytest.FixtureRequest) -> str:
    """The etcd image for the container fixtures, once a Docker engine and the image
    are known to be there (skip, or failure under ETCD_RDZV_REQUIRE_DOCKER=1, if not)."""
    from ._docker import DockerUnavailableError, EtcdImageError, ensure_etcd_image

    plugins = request.config.pluginmanager
    if not plugins.has_plugin("etcd_rdzv_container_logs"):
        plugins.register(_ContainerLogReport(), "etcd_rdzv_container_logs")
    try:
        return ensure_etcd_image()
    except (DockerUnavailableError, EtcdImageError) as exc:
        reason = f"{exc}\n{_HOW_TO_ENABLE}"
    skip_or_fail(reason, require=REQUIRE_DOCKER_ENV)


@pytest.fixture(scope="session")
def etcd_container(etcd_container_image: str) -> Iterator[EtcdContainer]:
    """One etcd member (v2 API on) in a container, for the whole session."""
    with EtcdContainer("session", image=etcd_container_image) as member:
        yield member


@pytest.fixture
def etcd_container_params(
    etcd_container: EtcdContainer, etcd_key_prefix: str
) -> Callable[..., RendezvousParameters]:
    """Factory of parameters for ``etcd_container`` under a fresh prefix."""

    def make(run_id: str = "run", **config: Any) -> RendezvousParameters:
        config.setdefault("key_prefix", etcd_key_prefix)
        return etcd_container.params(run_id, **config)

    return make


@pytest.fixture
def etcd_container_cluster(etcd_container_image: str) -> Iterator[EtcdContainerCluster]:
    """A fresh 3-member cluster (v2 API on) in containers, removed after the test."""
    with EtcdContainerCluster(3, image=etcd_container_image) as cluster:
        yield cluster
