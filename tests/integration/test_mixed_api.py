"""One run, one API, on an etcd that serves both (etcd 3.5 with ``--enable-v2``).

etcd keeps the v2 and v3 keyspaces apart, so a node on the other API than its run's
never sees the others. The rule (see docs/api.md, "Mixed configurations"):

* a node whose run has keys in the other keyspace and is not established in its own
  is refused, with an error that names the keys, the APIs and what to do; it writes
  nothing anywhere (its join key, coordinator key and life are gone again, no failure
  record, no close), so nothing it did makes a later node of the run fail;
* a run established in a keyspace goes on: keys of the run in the other keyspace (a
  mis-configured agent's, an old tool's) only get a WARNING, and a running job that
  re-forms its group keeps going;
* the first node of a new run that meets keys of its id in the other keyspace is
  refused (nothing tells them from the first nodes of a job there) until they are
  deleted.

Each case runs in both directions (a job on v2 with a node on v3, and the reverse).
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

import etcd_rdzv
from etcd_rdzv import EtcdRendezvousHandler, RendezvousParameters, RendezvousStateError, _keys
from etcd_rdzv.client import other_keyspace_keys
from etcd_rdzv.config.params import ClientConfig
from etcd_rdzv.rendezvous import records
from etcd_rdzv.runs.delete import delete_run
from etcd_rdzv.testing import EtcdRdzvCli, EtcdServer

from ._rawkv import raw_listing, raw_put
from ._waits import until

HANG = 60.0  # a generous bound that only catches hangs
OTHER = {"v2": "v3", "v3": "v2"}


def _snapshot(server: EtcdServer, prefix: str) -> dict[str, dict[str, str]]:
    """What both keyspaces hold below ``prefix``."""
    return {api: raw_listing(server.client_url, api, prefix) for api in ("v2", "v3")}


def _changes(before: dict[str, dict[str, str]], after: dict[str, dict[str, str]]) -> list[str]:
    """What differs between two snapshots, one line per key."""
    lines = []
    for api in ("v2", "v3"):
        for key in sorted(set(before[api]) | set(after[api])):
            old, new = before[api].get(key), after[api].get(key)
            if old != new:
                lines.append(f"{api} {key}: {old!r} -> {new!r}")
    return lines


def _settled(
    server: EtcdServer, prefix: str, api: str, run_id: str, round_no: int = 1
) -> dict[str, dict[str, str]]:
    """Both keyspaces once the chores after round ``round_no`` ran (the hint; round
    N-2's keys dropped; v2's sweep marker, made after the first round)."""
    hint = _keys.hint_key(prefix, run_id)
    old = _keys.round_dir(prefix, run_id, round_no - 2) + "/"
    marker = f"{prefix}/~swept/"

    def done() -> bool:
        held = raw_listing(server.client_url, api, prefix)
        dropped = round_no <= 2 or not any(k.startswith(old) for k in held)
        swept = api == "v3" or marker in held
        return held.get(hint) == str(round_no + 1) and dropped and swept

    _until(f"the chores after round {round_no}", done)
    return _snapshot(server, prefix)


_until = functools.partial(until, timeout=30.0, pause=0.05)


def _join(pool: ThreadPoolExecutor, nodes: list[EtcdRendezvousHandler]) -> list[Any]:
    """Every node's ``next_rendezvous()``, at once."""
    futures = [pool.submit(h.next_rendezvous) for h in nodes]
    return [f.result(timeout=HANG) for f in futures]


@pytest.fixture
def params(etcd_server: EtcdServer, etcd_key_prefix: str) -> Callable[..., RendezvousParameters]:
    """Parameters of the native handler on ``etcd_server`` (both APIs), fast timings."""

    def make(run_id: str, api: str, **config: Any) -> RendezvousParameters:
        config.setdefault("min_nodes", 2)
        config.setdefault("max_nodes", 3)
        config.setdefault("join_timeout", 30)
        config.setdefault("last_call_timeout", 1)
        config.setdefault("keep_alive_interval", 1)
        return etcd_server.params(
            run_id,
            backend="etcd-rdzv",
            api=api,
            key_prefix=etcd_key_prefix,
            read_timeout=5,
            local_addr="127.0.0.1",
            **config,
        )

    return make


@pytest.mark.parametrize("job_api", ["v2", "v3"])
def test_a_node_on_the_wrong_api_is_refused_and_writes_nothing(
    etcd_server: EtcdServer,
    etcd_key_prefix: str,
    params: Callable[..., RendezvousParameters],
    handlers: list[EtcdRendezvousHandler],
    pool: ThreadPoolExecutor,
    job_api: str,
) -> None:
    wrong = OTHER[job_api]
    job = [etcd_rdzv.create_handler(params("job", job_api)) for _ in range(2)]
    handlers.extend(job)
    assert sorted(r.rank for r in _join(pool, job)) == [0, 1]
    before = _settled(etcd_server, etcd_key_prefix, job_api, "job")
    assert not before[wrong]

    # As torchrun runs it (its shutdown closes the run), with quarantine on (a life).
    bad = etcd_rdzv.create_handler(
        params("job", wrong, min_nodes=1, host_id="bad-host", quarantine_deaths=3)
    )
    bad.close_on_shutdown = True
    with pytest.raises(RendezvousStateError) as info:
        bad.next_rendezvous()
    message = str(info.value)
    assert f"has keys under {etcd_key_prefix}/job/ in etcd's {job_api} keyspace" in message
    assert f"this node uses api={wrong}" in message and "same 'api' option" in message
    assert "rdzv/r1/result" in message  # the keys found, named
    assert f"etcd-rdzv delete --run-id job --api {job_api} --key-prefix" in message
    assert not _changes(before, _snapshot(etcd_server, etcd_key_prefix))  # nothing left
    assert bad.shutdown()
    assert not _changes(before, _snapshot(etcd_server, etcd_key_prefix))  # not closed

    # The job did not notice, and its run still takes nodes on its API.
    assert [h.num_nodes_waiting() for h in job] == [0, 0]
    third = etcd_rdzv.create_handler(params("job", job_api))
    handlers.append(third)
    late = pool.submit(third.next_rendezvous)
    _until("the members see the late node", lambda: job[0].num_nodes_waiting() == 1)
    worlds = {r.world_size for r in _join(pool, job)} | {late.result(HANG).world_size}
    assert worlds == {3}


@pytest.mark.parametrize("job_api", ["v2", "v3"])
def test_a_stray_key_in_the_other_keyspace_never_ends_a_running_job(
    etcd_server: EtcdServer,
    etcd_key_prefix: str,
    params: Callable[..., RendezvousParameters],
    handlers: list[EtcdRendezvousHandler],
    pool: ThreadPoolExecutor,
    job_api: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    wrong = OTHER[job_api]
    opts = {"min_nodes": 1, "last_call_timeout": 2}
    job = [etcd_rdzv.create_handler(params("job", job_api, **opts)) for _ in range(3)]
    handlers.extend(job)
    assert {r.world_size for r in _join(pool, job)} == {3}
    # The fault record an older release's refused node left in the other keyspace.
    stray = _keys.result_key(etcd_key_prefix, "job", 1)
    raw_put(etcd_server.client_url, wrong, stray, records.fault_record("wrong api", ("x",)))

    # A member leaves, then another: each time the rest re-form the group and go on.
    caplog.set_level(logging.WARNING, logger="etcd_rdzv")
    for left in (2, 1):
        job[left].shutdown()
        members = job[:left]
        _until("a member is seen gone", lambda m=members: all(h.num_nodes_waiting() for h in m))
        assert {r.world_size for r in _join(pool, members)} == {left}
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    said = [w for w in warnings if f"etcd's {wrong} keyspace holds 1 key(s)" in w]
    assert said, warnings
    assert "rdzv/r1/result" in said[0] and f"a node on api={wrong} is refused" in said[0]
    assert f"etcd-rdzv delete --run-id job --api {wrong} --key-prefix" in said[0]

    # A node on the stray keys' API is refused (they are no run), and writes nothing.
    before = _settled(etcd_server, etcd_key_prefix, job_api, "job", round_no=3)
    bad = etcd_rdzv.create_handler(params("job", wrong, min_nodes=1))
    with pytest.raises(RendezvousStateError, match=f"etcd's {job_api} keyspace"):
        bad.next_rendezvous()
    bad.shutdown()
    assert not _changes(before, _snapshot(etcd_server, etcd_key_prefix))
    assert job[0].num_nodes_waiting() == 0  # the job did not notice


@pytest.mark.parametrize("new_api", ["v2", "v3"])
def test_a_new_run_meeting_its_id_in_the_other_keyspace_is_refused_until_deleted(
    etcd_server: EtcdServer,
    etcd_key_prefix: str,
    params: Callable[..., RendezvousParameters],
    handlers: list[EtcdRendezvousHandler],
    new_api: str,
) -> None:
    # Nothing tells a stray key from the first nodes of a job on the other API: the
    # first node of a new run is refused (writing nothing) until the keys are deleted.
    other = OTHER[new_api]
    stray = _keys.excluded_key(etcd_key_prefix, "fresh", "gpu-07")
    raw_put(etcd_server.client_url, other, stray, "an old tool's")
    before = _snapshot(etcd_server, etcd_key_prefix)
    first = etcd_rdzv.create_handler(params("fresh", new_api, min_nodes=1))
    handlers.append(first)
    with pytest.raises(RendezvousStateError) as info:
        first.next_rendezvous()
    assert f"etcd's {other} keyspace" in str(info.value), info.value
    assert "rdzv/hosts/excluded/" in str(info.value), info.value
    assert not _changes(before, _snapshot(etcd_server, etcd_key_prefix))

    kv = etcd_rdzv.create_client(etcd_server.params("-", api=other, key_prefix=etcd_key_prefix))
    try:
        assert delete_run(kv, etcd_key_prefix, "fresh").keys == 1
    finally:
        kv.close()
    assert first.next_rendezvous().world_size == 1


@pytest.mark.parametrize("job_api", ["v2", "v3"])
def test_a_group_on_the_wrong_api_is_refused_node_by_node(
    params: Callable[..., RendezvousParameters],
    handlers: list[EtcdRendezvousHandler],
    pool: ThreadPoolExecutor,
    job_api: str,
) -> None:
    # Several nodes on the wrong API at once: the coordinator is refused and leaves;
    # each of the others takes over in turn and is refused too. None hangs.
    wrong = OTHER[job_api]
    alone = etcd_rdzv.create_handler(params("mixed", job_api, min_nodes=1, max_nodes=1))
    handlers.append(alone)
    assert alone.next_rendezvous().world_size == 1
    bad = [etcd_rdzv.create_handler(params("mixed", wrong)) for _ in range(2)]
    handlers.extend(bad)
    errors: list[BaseException] = []

    def join(h: EtcdRendezvousHandler) -> None:
        try:
            h.next_rendezvous()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=join, args=(h,)) for h in bad]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(HANG)
    assert not any(t.is_alive() for t in threads), "a join hung"
    assert len(errors) == 2, errors
    for exc in errors:
        assert isinstance(exc, RendezvousStateError), exc
        assert f"etcd's {job_api} keyspace" in str(exc) and f"api={wrong}" in str(exc), exc


def test_a_backend_client_is_refused_only_where_its_run_is_not(
    etcd_server: EtcdServer, etcd_key_prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    # At connect (create_client, create_backend: torch's dynamic handler), before the
    # client wrote anything: refused when the run lives only in the other keyspace.
    def params(run_id: str, api: str) -> RendezvousParameters:
        return etcd_server.params(run_id, api=api, key_prefix=etcd_key_prefix, read_timeout=5)

    v2_backend, _ = etcd_rdzv.create_backend(params("job-a", "v2"))
    v2_backend.set_state(b"on v2")
    with pytest.raises(RendezvousStateError, match=r"api=v3.*same 'api' option") as info:
        etcd_rdzv.create_backend(params("job-a", "v3"))
    assert "v2 keyspace" in str(info.value) and "'job-a'" in str(info.value)
    assert "(state)" in str(info.value)  # the key found
    assert f"etcd-rdzv delete --run-id job-a --api v2 --key-prefix {etcd_key_prefix}" in str(
        info.value
    )

    v3_backend, _ = etcd_rdzv.create_backend(params("job-b", "v3"))
    v3_backend.set_state(b"on v3")
    with pytest.raises(RendezvousStateError, match=r"v3 keyspace.*api=v2"):
        etcd_rdzv.create_backend(params("job-b", "v2"))
    with pytest.raises(RendezvousStateError):
        etcd_rdzv.create_client(params("job-b", "v2"))
    assert not raw_listing(etcd_server.client_url, "v2", f"{etcd_key_prefix}/job-b")

    # A stray key in the other keyspace of a run established here: a WARNING, no refusal.
    stray = f"{etcd_key_prefix}/job-b/rdzv/closed"
    raw_put(etcd_server.client_url, "v2", stray, "an old tool's")
    caplog.set_level(logging.WARNING, logger="etcd_rdzv")
    again, _ = etcd_rdzv.create_backend(params("job-b", "v3"))
    assert again.get_state()[0] == b"on v3"  # type: ignore[index]
    assert any("rdzv/closed" in r.getMessage() for r in caplog.records), caplog.records
    # What a tool (etcd-rdzv status) can show of it.
    kv = etcd_rdzv.create_client(params("job-b", "v3"))
    try:
        config = ClientConfig.from_params(params("job-b", "v3"))
        found = other_keyspace_keys(kv, config)
        assert found is not None and (found.api, found.keys, found.count) == ("v2", (stray,), 1)
        assert other_keyspace_keys(kv, ClientConfig.from_params(params("job-c", "v3"))) is None
    finally:
        kv.close()
    # ... and a node on v2 is still refused: the stray key is no run.
    with pytest.raises(RendezvousStateError, match=r"v3 keyspace.*api=v2"):
        etcd_rdzv.create_backend(params("job-b", "v2"))

    # Each API still serves its own runs, and new runs on either.
    assert v2_backend.get_state()[0] == b"on v2"  # type: ignore[index]
    assert etcd_rdzv.create_backend(params("job-a", "v2"))[0].get_state() is not None
    assert etcd_rdzv.create_backend(params("job-c", "v3"))[0].get_state() is None


def test_the_cli_join_on_the_wrong_api_leaves_the_run_usable(
    etcd_server: EtcdServer, etcd_key_prefix: str, etcd_rdzv_cli: EtcdRdzvCli
) -> None:
    # The reported case: a join without --api (v3) on a v2 run.
    conn = ["--run-id", "r1", "--endpoint", etcd_server.endpoint, "--key-prefix", etcd_key_prefix]
    first = etcd_rdzv_cli.run("join", "--min-nodes", "1", "--api", "v2", *conn)
    assert first.returncode == 0, first.stderr
    before = _snapshot(etcd_server, etcd_key_prefix)
    refused = etcd_rdzv_cli.run("join", "--min-nodes", "1", *conn)
    assert refused.returncode == 1 and "etcd's v2 keyspace" in refused.stderr, refused.stderr
    assert "api=v3" in refused.stderr
    assert not _changes(before, _snapshot(etcd_server, etcd_key_prefix))
    # The v2 run is as usable as before: status and a join on v2 work.
    status = etcd_rdzv_cli.run("status", "--api", "v2", *conn)
    assert status.returncode == 0, status.stderr
    again = etcd_rdzv_cli.run("join", "--min-nodes", "1", "--api", "v2", *conn)
    assert again.returncode == 0, again.stderr
