"""The native handler (``etcd_rdzv.create_handler``) on a real etcd, every node a process.

Each node is ``_handler_node.py`` in a child process of its own: it builds its handler,
waits for commands on stdin (``join``, ``close``, ``status``, ``shutdown``, ``exit``)
and reports events as ``EVT <json>`` lines on stdout (see that module). Nodes are
started first and told to ``join`` together once all of them are ready, so the slow
part (imports) never staggers the joins. Every wait here has a deadline; a failed
wait shows every node's output; every node is killed when its test ends, and kills
itself after ``max_life`` seconds should the test process die.

With torch installed, ``create_handler`` gives torch's flavour of the handler
(``next_rendezvous()`` returns torch's ``RendezvousInfo``, errors are also torch's).
The tests where that matters (return type, error types, round 2 with rank 0's
bootstrap store) run it; the others hide torch from their nodes (``use_torch=False``),
which covers the torch-free path and saves the 2 s torch import of each process.

Every test runs twice, on the etcd v2 API and on the v3 API (the ``etcd_api_params``
fixture; v3 runs on a member without the v2 API). Timings are small (last call 2 s,
heartbeat every 1 s, a node counts as dead after 2 missed beats) so each API's run
takes well under a minute. Event times (``t``) are the
nodes' ``time.monotonic()``, one machine-wide clock on Linux and macOS, so they are
compared with the test's own.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from etcd_rdzv import RendezvousParameters
from etcd_rdzv.testing import EtcdServer
from etcd_rdzv.testing.pytest_plugin import variant_server_options

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parent.parent
NODE_SCRIPT = HERE / "_handler_node.py"
MARK = "EVT "

KEEP_ALIVE_INTERVAL = 1
KEEP_ALIVE_MAX_ATTEMPT = 2
READY_TIMEOUT = 45.0  # importing torch in several processes at once on 2 cores
NODE_MAX_LIFE = 120.0  # a node exits on its own after this long

OURS = "etcd_rdzv.errors."
TORCH_API = "torch.distributed.elastic.rendezvous.api."
TORCH_INFO = TORCH_API + "RendezvousInfo"
PLAIN_INFO = "etcd_rdzv.handler.RendezvousResult"
TORCH_INSTALLED = importlib.util.find_spec("torch") is not None

Event = dict[str, Any]


class Node:
    """One node process: commands go to its stdin, events come from its stdout file."""

    def __init__(self, name: str, spec: dict[str, Any], workdir: Path) -> None:
        self.name = name
        self.stdout_path = workdir / f"{name}.stdout"
        self.stderr_path = workdir / f"{name}.stderr"
        env = dict(os.environ)
        env["PYTHONUNBUFFERED"] = "1"
        env["OMP_NUM_THREADS"] = "1"
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
        spec = {**spec, "max_life": NODE_MAX_LIFE}
        with open(self.stdout_path, "wb") as out, open(self.stderr_path, "wb") as err:
            self.popen = subprocess.Popen(
                [sys.executable, str(NODE_SCRIPT), json.dumps(spec)],
                stdin=subprocess.PIPE,
                stdout=out,
                stderr=err,
                env=env,
                cwd=str(workdir),
                start_new_session=True,
            )
        self.node_id: str | None = None
        self.use_torch = bool(spec.get("torch", True))

    @property
    def alive(self) -> bool:
        return self.popen.poll() is None

    def send(self, command: str) -> None:
        assert self.popen.stdin is not None
        with contextlib.suppress(BrokenPipeError, OSError):
            self.popen.stdin.write(command.encode() + b"\n")
            self.popen.stdin.flush()

    def events(self, kind: str | None = None) -> list[Event]:
        found = []
        for line in self.stdout_path.read_text(errors="replace").splitlines():
            if line.startswith(MARK):
                with contextlib.suppress(ValueError):
                    event = json.loads(line[len(MARK) :])
                    if kind is None or event["event"] == kind:
                        found.append(event)
        return found

    def kill(self) -> float:
        """SIGKILL the node (its own process group); returns the monotonic time of the kill."""
        killed_at = time.monotonic()
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.popen.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout=10)
        if self.popen.stdin is not None:
            with contextlib.suppress(OSError):
                self.popen.stdin.close()
        return killed_at

    def describe(self, tail: int = 40) -> str:
        def last(path: Path) -> str:
            try:
                return "\n".join(path.read_text(errors="replace").splitlines()[-tail:])
            except OSError:
                return "(none)"

        return (
            f"=== node {self.name} ({self.node_id}): exit code {self.popen.poll()}\n"
            f"--- stdout\n{last(self.stdout_path)}\n--- stderr\n{last(self.stderr_path)}"
        )


class Nodes:
    """The nodes of one test, with bounded waits on their events."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.all: list[Node] = []

    def start(self, name: str, params: RendezvousParameters, use_torch: bool = True) -> Node:
        """Start a node; ``use_torch=False`` hides torch from it (the torch-free path)."""
        spec = {
            "torch": use_torch,
            "backend": params.backend,
            "endpoint": params.endpoint,
            "run_id": params.run_id,
            "min_nodes": params.min_nodes,
            "max_nodes": params.max_nodes,
            "config": params.config,
        }
        node = Node(name, spec, self.workdir)
        self.all.append(node)
        return node

    def describe(self) -> str:
        return "\n".join(node.describe() for node in self.all)

    def wait_event(
        self,
        node: Node,
        kind: str,
        timeout: float,
        match: Callable[[Event], bool] = lambda e: True,
    ) -> Event:
        """The first ``kind`` event of ``node`` that matches; fails after ``timeout`` s."""
        deadline = time.monotonic() + timeout
        while True:
            for event in node.events(kind):
                if match(event):
                    return event
            if not node.alive:
                # one last read: the event may have been written just before the exit
                for event in node.events(kind):
                    if match(event):
                        return event
                pytest.fail(
                    f"node {node.name} exited without a matching {kind!r} event\n{self.describe()}"
                )
            if time.monotonic() >= deadline:
                pytest.fail(
                    f"no matching {kind!r} event from node {node.name} within {timeout}s\n"
                    f"{self.describe()}"
                )
            time.sleep(0.02)

    def ready(self, nodes: list[Node] | None = None) -> None:
        """Wait until every node built its handler; learn their node ids."""
        for node in nodes or self.all:
            ready = self.wait_event(node, "ready", READY_TIMEOUT)
            node.node_id = ready["node_id"]
            self.check(
                ready["torch"] == (node.use_torch and TORCH_INSTALLED),
                f"node {node.name}: torch integration active={ready['torch']}, "
                f"use_torch={node.use_torch}, torch installed={TORCH_INSTALLED}",
            )

    def join(self, nodes: list[Node]) -> None:
        for node in nodes:
            node.send("join")

    def rendezvous(self, nodes: list[Node], timeout: float, round_no: int = 1) -> list[Event]:
        """Each node's ``rendezvous`` event of ``round_no``."""
        deadline = time.monotonic() + timeout
        return [
            self.wait_event(
                node,
                "rendezvous",
                max(deadline - time.monotonic(), 0.1),
                lambda e: e["round"] == round_no,
            )
            for node in nodes
        ]

    def status(self, node: Node, timeout: float = 10.0) -> Event:
        """Ask ``node`` for its status and return the answer."""
        asked_at = time.monotonic()
        node.send("status")
        return self.wait_event(node, "status", timeout, lambda e: e["t"] >= asked_at)

    def check(self, condition: bool, message: str) -> None:
        if not condition:
            pytest.fail(f"{message}\n{self.describe()}")

    def kill_all(self) -> None:
        for node in self.all:
            node.kill()


@pytest.fixture
def nodes(tmp_path: Path) -> Iterator[Nodes]:
    group = Nodes(tmp_path)
    try:
        yield group
    finally:
        group.kill_all()


@pytest.fixture
def rdzv_params(
    etcd_api_params: Callable[..., RendezvousParameters],
) -> Callable[..., RendezvousParameters]:
    """``rdzv_params(run_id, min_nodes=..., max_nodes=..., **options)`` with fast timings,
    for the etcd API the test runs on (every test here runs on v2 and on v3)."""

    def make(run_id: str = "run", **config: Any) -> RendezvousParameters:
        config.setdefault("backend", "etcd-rdzv")
        config.setdefault("last_call_timeout", 2)
        config.setdefault("keep_alive_interval", KEEP_ALIVE_INTERVAL)
        config.setdefault("keep_alive_max_attempt", KEEP_ALIVE_MAX_ATTEMPT)
        config.setdefault("join_timeout", 30)
        config.setdefault("read_timeout", 10)
        return etcd_api_params(run_id, **config)

    return make


def _torch_active(node: Node) -> bool:
    return bool(node.events("ready")[0]["torch"])


def _assert_consistent(group: Nodes, results: list[Event], world_size: int) -> tuple[str, ...]:
    """Every result agrees on the members; ranks are 0..world_size-1; each rank is its own."""
    members = {tuple(r["members"]) for r in results}
    group.check(len(members) == 1, f"members differ between nodes: {members}")
    (agreed,) = members
    group.check(
        all(r["world_size"] == world_size for r in results)
        and sorted(r["rank"] for r in results) == list(range(world_size))
        and len(agreed) == world_size,
        f"expected world size {world_size} and ranks 0..{world_size - 1}: {results}",
    )
    group.check(
        all(agreed[r["rank"]] == r["node_id"] for r in results),
        f"a node's rank is not its index in the member list: {results}",
    )
    for r in results:
        expected = TORCH_INFO if r["torch"] else PLAIN_INFO
        group.check(r["info_type"] == expected, f"next_rendezvous() returned {r['info_type']}")
    return agreed


def test_three_nodes_complete_after_the_last_call(
    nodes: Nodes, rdzv_params: Callable[..., RendezvousParameters]
) -> None:
    params = rdzv_params(min_nodes=2, max_nodes=4, last_call_timeout=2)
    group = [nodes.start(f"n{i}", params) for i in range(3)]
    nodes.ready()
    nodes.join(group)
    results = nodes.rendezvous(group, timeout=20)

    members = _assert_consistent(nodes, results, world_size=3)
    nodes.check(set(members) == {n.node_id for n in group}, f"wrong members {members}")
    nodes.check({r["round"] for r in results} == {1}, f"not round 1: {results}")
    elapsed = [round(r["elapsed"], 2) for r in results]
    print(f"completion times (s) with last_call_timeout=2: {elapsed}")
    # Below max_nodes the round waits for the last call (not complete at min_nodes) ...
    nodes.check(max(elapsed) >= 1.8, f"completed before the last call ended: {elapsed}")
    # ... and not much longer (last call + the followers' 1 s grace + slack).
    nodes.check(max(elapsed) <= 2 + 1 + 4, f"completed too late: {elapsed}")


def test_max_nodes_completes_at_once_and_the_extra_node_waits(
    nodes: Nodes, rdzv_params: Callable[..., RendezvousParameters]
) -> None:
    # min_nodes=1: the fifth node alone would be enough for a round of its own.
    last_call = 2
    params = rdzv_params(min_nodes=1, max_nodes=4, last_call_timeout=last_call)
    group = [nodes.start(f"n{i}", params, use_torch=False) for i in range(5)]
    nodes.ready()
    nodes.join(group)

    deadline = time.monotonic() + 10
    while len([n for n in group if n.events("rendezvous")]) < 4:
        nodes.check(time.monotonic() < deadline, "four nodes did not complete within 10 s")
        nodes.check(all(n.alive for n in group), "a node exited")
        time.sleep(0.02)
    done = [n for n in group if n.events("rendezvous")]
    results = [n.events("rendezvous")[0] for n in done]
    members = _assert_consistent(nodes, results, world_size=4)
    (extra,) = (n for n in group if n not in done)
    nodes.check(extra.node_id not in members, f"the fifth node is a member: {members}")
    elapsed = [round(r["elapsed"], 2) for r in results]
    print(f"completion times (s) at max_nodes=4: {elapsed}")
    # At once when max_nodes joined: no last call.
    nodes.check(max(elapsed) < last_call - 0.5, f"max_nodes waited for the last call: {elapsed}")

    # The fifth waits in the next round, and every member sees it waiting.
    waits_from = nodes.wait_event(extra, "key-written", 10, lambda e: e["round"] == 2)["t"]
    for node in done:
        nodes.wait_event(node, "waiting", 10, lambda e: e["n"] >= 1)
    # Exclusivity: while round 1 runs the fifth never completes a round of its own,
    # though it alone meets min_nodes. Watch it for longer than its last call would
    # take (+ 1 s grace + 1.5 s slack): a bounded look for something that must not happen.
    window_end = waits_from + last_call + 1 + 1.5
    while time.monotonic() < window_end:
        nodes.check(
            extra.alive and not extra.events("rendezvous") and not extra.events("error"),
            "the fifth node should still be waiting",
        )
        time.sleep(0.05)


def test_node_killed_before_completion_is_dropped(
    nodes: Nodes, rdzv_params: Callable[..., RendezvousParameters]
) -> None:
    # The last call (5 s) outlasts the victim's key (2 s TTL after its last beat).
    params = rdzv_params(min_nodes=2, max_nodes=4, last_call_timeout=5)
    group = [nodes.start(f"n{i}", params, use_torch=False) for i in range(3)]
    nodes.ready()
    nodes.join(group)
    for node in group:
        nodes.wait_event(node, "key-written", 10, lambda e: e["round"] == 1)
    victim, survivors = group[2], group[:2]
    nodes.check(not victim.events("rendezvous"), "the victim completed before it was killed")
    killed_at = victim.kill()

    results = nodes.rendezvous(survivors, timeout=20)
    members = _assert_consistent(nodes, results, world_size=2)
    nodes.check(victim.node_id not in members, f"the killed node is a member: {members}")
    print(
        "survivors completed without the killed node "
        f"{[round(r['t'] - killed_at, 2) for r in results]} s after the kill"
    )


def test_member_killed_after_completion_is_detected(
    nodes: Nodes, rdzv_params: Callable[..., RendezvousParameters]
) -> None:
    params = rdzv_params(min_nodes=3, max_nodes=3)
    group = [nodes.start(f"n{i}", params, use_torch=False) for i in range(3)]
    nodes.ready()
    nodes.join(group)
    _assert_consistent(nodes, nodes.rendezvous(group, timeout=15), world_size=3)
    victim, survivors = group[0], group[1:]
    for node in survivors:  # nothing waiting yet
        nodes.check(nodes.status(node)["waiting"] == 0, "num_nodes_waiting() > 0 before the kill")

    killed_at = victim.kill()
    bound = KEEP_ALIVE_INTERVAL * KEEP_ALIVE_MAX_ATTEMPT + 3
    detected = [
        nodes.wait_event(node, "waiting", bound + 10, lambda e: e["n"] >= 1 and e["t"] > killed_at)
        for node in survivors
    ]
    times = [round(e["t"] - killed_at, 2) for e in detected]
    print(f"dead member detected after {times} s (bound {bound} s, node TTL 2 s)")
    nodes.check(max(times) <= bound, f"detection took {times} s, more than {bound} s")


def test_set_closed_is_seen_by_all_and_refuses_new_nodes(
    nodes: Nodes, rdzv_params: Callable[..., RendezvousParameters]
) -> None:
    params = rdzv_params(min_nodes=2, max_nodes=2)
    a, b, late = (nodes.start(name, params) for name in ("a", "b", "late"))
    nodes.ready()
    nodes.join([a, b])
    _assert_consistent(nodes, nodes.rendezvous([a, b], timeout=15), world_size=2)
    nodes.check(not nodes.status(b)["is_closed"], "closed before set_closed()")

    a.send("close")
    nodes.wait_event(a, "closed", 10)
    nodes.check(nodes.status(b)["is_closed"], "b does not see the run closed")
    nodes.check(nodes.status(late)["is_closed"], "a new node does not see the run closed")

    nodes.join([late])
    error = nodes.wait_event(late, "error", 10)
    nodes.check(
        OURS + "RendezvousClosedError" in error["kinds"], f"not RendezvousClosedError: {error}"
    )
    if _torch_active(late):
        nodes.check(TORCH_API + "RendezvousClosedError" in error["kinds"], f"not torch's: {error}")
    print(f"closed error after {error['elapsed']:.2f} s")


def test_join_timeout(nodes: Nodes, rdzv_params: Callable[..., RendezvousParameters]) -> None:
    params = rdzv_params(min_nodes=2, max_nodes=2, join_timeout=2)
    (alone,) = [nodes.start("alone", params)]
    nodes.ready()
    nodes.join([alone])
    error = nodes.wait_event(alone, "error", 2 + 10)
    nodes.check(
        OURS + "RendezvousTimeoutError" in error["kinds"], f"not RendezvousTimeoutError: {error}"
    )
    if _torch_active(alone):
        nodes.check(TORCH_API + "RendezvousTimeoutError" in error["kinds"], f"not torch's: {error}")
    print(f"join timeout (2 s) raised after {error['elapsed']:.2f} s")
    nodes.check(1.9 <= error["elapsed"] <= 2 + 3, f"timed out after {error['elapsed']:.2f} s")


def test_second_round_with_changed_membership_keeps_ranks(
    nodes: Nodes, rdzv_params: Callable[..., RendezvousParameters]
) -> None:
    params = rdzv_params(min_nodes=3, max_nodes=3)
    first = [nodes.start(f"n{i}", params) for i in range(3)]
    newcomer = nodes.start("new", params)
    nodes.ready()
    nodes.join(first)
    round1 = {r["node_id"]: r for r in nodes.rendezvous(first, timeout=15)}
    _assert_consistent(nodes, list(round1.values()), world_size=3)

    # The rank 1 member leaves; the others (ranks 0 and 2) see it gone.
    leaver = next(n for n in first if round1[n.node_id]["rank"] == 1)
    # Highest rank first: ranks by arrival alone would then differ from the old ones.
    survivors = sorted(
        (n for n in first if n is not leaver), key=lambda n: -round1[n.node_id]["rank"]
    )
    leaver.send("shutdown")
    nodes.wait_event(leaver, "shutdown", 10, lambda e: e["ok"])
    for node in survivors:
        nodes.wait_event(node, "waiting", 10, lambda e: e["n"] >= 1)

    # A new node joins and waits for round 2 while round 1 still runs.
    nodes.join([newcomer])
    nodes.wait_event(newcomer, "key-written", 10, lambda e: e["round"] == 2)
    nodes.check(not newcomer.events("rendezvous"), "round 2 formed while round 1 still ran")

    # The survivors re-rendezvous: round 2 is the survivors and the new node.
    for node in survivors:
        node.send("join")
        nodes.wait_event(node, "key-written", 10, lambda e: e["round"] == 2)
    group = [*survivors, newcomer]
    round2 = {r["node_id"]: r for r in nodes.rendezvous(group, timeout=15, round_no=2)}
    members = _assert_consistent(nodes, list(round2.values()), world_size=3)
    nodes.check(set(members) == {n.node_id for n in group}, f"wrong members {members}")
    for node in survivors:
        old, new = round1[node.node_id]["rank"], round2[node.node_id]["rank"]
        nodes.check(old == new, f"survivor {node.node_id} changed rank {old} -> {new}")
    nodes.check(round2[newcomer.node_id]["rank"] == 1, "the new node did not get the free rank")
    print(
        "round 2 completed in "
        f"{[round(round2[n.node_id]['elapsed'], 2) for n in group]} s (survivors, new node)"
    )


def test_other_run_id_never_sees_old_state(
    nodes: Nodes, rdzv_params: Callable[..., RendezvousParameters]
) -> None:
    # Run A: two complete, a third waits for A's next round.
    params_a = rdzv_params("job", min_nodes=2, max_nodes=2)
    # Run B, same key prefix, an id that A's is a prefix of.
    params_b = rdzv_params("job-b", min_nodes=1, max_nodes=1)
    group_a = [nodes.start(f"a{i}", params_a, use_torch=False) for i in range(3)]
    b = nodes.start("b", params_b, use_torch=False)
    nodes.ready()
    nodes.join(group_a)

    deadline = time.monotonic() + 15
    while len([n for n in group_a if n.events("rendezvous")]) < 2:
        nodes.check(time.monotonic() < deadline, "run A did not complete within 15 s")
        time.sleep(0.02)
    members_a = [n for n in group_a if n.events("rendezvous")]
    (waiter,) = (n for n in group_a if n not in members_a)
    nodes.wait_event(waiter, "key-written", 10, lambda e: e["round"] == 2)
    for node in members_a:
        nodes.wait_event(node, "waiting", 10, lambda e: e["n"] >= 1)

    nodes.join([b])
    (result,) = nodes.rendezvous([b], timeout=10)
    nodes.check(
        (result["rank"], result["world_size"], result["round"], result["members"])
        == (0, 1, 1, [b.node_id]),
        f"run B did not complete alone in its round 1: {result}",
    )
    nodes.check(result["elapsed"] < 3, f"run B took {result['elapsed']:.2f} s alone")
    print(f"run B completed alone in {result['elapsed']:.2f} s")

    # Run A is untouched by B: still exactly one node waiting, which did not complete.
    for node in members_a:
        nodes.check(nodes.status(node)["waiting"] == 1, "run A counts run B's node")
    nodes.check(not waiter.events("rendezvous"), "run A's waiting node completed")
    nodes.check(nodes.status(b)["waiting"] == 0, "run B counts run A's nodes")


def test_join_rides_out_an_etcd_outage(
    nodes: Nodes, etcd_variant: str, etcd_api: str, etcd_key_prefix: str
) -> None:
    """etcd is down for a while (every request refused) while a node waits in a round:
    the join tries again until etcd is back, within join_timeout, instead of failing
    on the first refused request."""
    outage = 4.0
    with EtcdServer("outage", **variant_server_options(etcd_variant)) as server:
        params = server.params(
            "run",
            backend="etcd-rdzv",
            key_prefix=etcd_key_prefix,
            api=etcd_api,
            min_nodes=2,
            max_nodes=2,
            join_timeout=60,
            read_timeout=2,
            keep_alive_interval=KEEP_ALIVE_INTERVAL,
            keep_alive_max_attempt=KEEP_ALIVE_MAX_ATTEMPT,
        )
        first = nodes.start("first", params, use_torch=False)
        second = nodes.start("second", params, use_torch=False)
        nodes.ready()
        nodes.join([first])
        # Let the first node settle into waiting for the second.
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if "coordinates round 1" in first.stderr_path.read_text():
                break
            time.sleep(0.05)
        server.kill()
        time.sleep(outage)
        nodes.check(not first.events("error"), "the waiting node failed during the outage")
        server.start()  # same ports and data
        nodes.join([second])
        results = nodes.rendezvous([first, second], timeout=40)
    _assert_consistent(nodes, results, world_size=2)
    log = first.stderr_path.read_text()
    nodes.check("trying again" in log, "the waiting node never saw a failed request")
    print(f"completion after an outage of {outage:.0f} s: {[r['elapsed'] for r in results]}")
