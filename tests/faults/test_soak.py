"""Soak: consecutive rendezvous rounds while cluster members keep failing.

Four node processes call ``next_rendezvous()`` round after round (``min_nodes =
max_nodes = 4``, so a round completes as soon as all four joined). Meanwhile a chaos
thread kills, stops, pauses and restarts members, one at a time, so a majority is
always up, and checks that each fault happened (its member stopped answering). It
runs until at least ``ROUNDS`` rounds completed and ``MIN_FAULTS`` faults were
injected; then every node stops after the same round. Fewer faults, or one that did
not happen, is a failure too. Every round must
complete with ranks 0..3, one per node, and one member list (checked over every
node's recorded outcomes by :mod:`etcd_rdzv.testing.history`); any error,
inconsistent or missing round counts as a failure, and the test wants none.

``ETCD_RDZV_SOAK_SEED`` replays a run's fault sequence (the seed is printed).
"""

from __future__ import annotations

import os
import random
import statistics
import threading
import time
from collections import Counter
from collections.abc import Callable

from etcd_rdzv import RendezvousParameters
from etcd_rdzv.testing import EtcdCluster, EtcdServer
from etcd_rdzv.testing.history import from_fleet, violations
from fleet import Event, Fleet

from ._harness import READY_TIMEOUT, RETRIES, leader_of

ROUNDS = 60  # at least this many rounds ...
MIN_FAULTS = 10  # ... and until at least this many faults were injected
NODES = 4
SOAK_TIMEOUT = 150.0  # seconds for all of it; a stuck round fails the test here
PROBE = 0.3  # seconds a member that is down gets to answer the readiness probe


class Chaos(threading.Thread):
    """Injects one fault at a time until stopped; a majority always stays up."""

    def __init__(self, cluster: EtcdCluster, rng: random.Random) -> None:
        super().__init__(name="chaos", daemon=True)
        self.cluster = cluster
        self.rng = rng
        self.stopped = threading.Event()
        self.faults: list[tuple[float, str, str, float]] = []  # (start, kind, member, seconds)
        #: Faults whose member still answered its readiness probe while it was meant
        #: to be down: faults that did not happen (the test fails on any).
        self.unseen: list[str] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            while not self.stopped.wait(self.rng.uniform(0.2, 0.8)):
                self._one_fault()
        except BaseException as exc:  # the test reports it
            self.error = exc

    def _one_fault(self) -> None:
        kind = self.rng.choice(["kill-leader", "kill", "stop", "pause", "pause-leader"])
        if kind.endswith("leader"):
            member = leader_of(self.cluster)
        else:
            member = self.rng.choice(self.cluster.members)
        down = self.rng.uniform(0.2, 1.2)
        started = time.monotonic()
        if kind.startswith("pause"):
            member.pause()
            try:
                self._see_down(kind, member)
                self.stopped.wait(down)
            finally:
                member.resume()
        else:
            if kind == "stop":
                member.stop()  # SIGTERM: a graceful stop
            else:
                member.kill()
            self._see_down(kind, member)
            self.stopped.wait(down)
            member.start()  # same ports and data; waits until it is healthy again
        self.faults.append((started, kind, member.endpoint, time.monotonic() - started))

    def _see_down(self, kind: str, member: EtcdServer) -> None:
        """Check that the fault happened: the member does not answer its readiness
        probe (a paused one within PROBE seconds, a stopped one at all)."""
        if member.health(timeout=PROBE):
            self.unseen.append(f"{kind} {member.endpoint}: it still answered")


def _summary(durations: list[float]) -> str:
    ordered = sorted(durations)
    p95 = ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))]
    return (
        f"min {ordered[0]:.2f} median {statistics.median(ordered):.2f} "
        f"p95 {p95:.2f} max {ordered[-1]:.2f}"
    )


def test_soak_rounds_under_member_faults(
    api: str,
    cluster: EtcdCluster,
    cluster_params: Callable[..., RendezvousParameters],
    fleet: Fleet,
) -> None:
    seed = int(os.environ.get("ETCD_RDZV_SOAK_SEED") or random.randrange(1 << 30))
    options = {
        "backend": "etcd-rdzv",
        "min_nodes": NODES,
        "max_nodes": NODES,
        # Longer than any pause (a paused member's requests wait it out) and than an
        # election on a busy machine (a write sent during one waits for the new leader).
        "read_timeout": 4,
        "keep_alive_interval": 1,
        "keep_alive_max_attempt": 6,  # a key outlives any single fault here
        "join_timeout": 60,
    }
    nodes = [fleet.start(f"n{i}", cluster_params(first=i, **options)) for i in range(NODES)]
    fleet.ready(timeout=READY_TIMEOUT)

    chaos = Chaos(cluster, random.Random(seed))
    chaos.start()
    started = time.monotonic()
    try:
        for node in nodes:
            node.join(rounds=0, retries=RETRIES)  # round after round, until told to finish
        # Stuck nodes are reported below with everything else, not failed here.
        while time.monotonic() - started < SOAK_TIMEOUT:
            done = min(len(n.events("round")) for n in nodes)
            if done >= ROUNDS and len(chaos.faults) >= MIN_FAULTS:
                break
            time.sleep(0.1)
        # Every node stops after the same round, a little ahead of the fastest.
        last = max((e["round"] for n in nodes for e in n.events("round")), default=0)
        for node in nodes:
            node.send("finish", round=last + 2)
        while time.monotonic() - started < SOAK_TIMEOUT and not all(
            n.events("done") or not n.alive for n in nodes
        ):
            time.sleep(0.1)
    finally:
        chaos.stopped.set()
        chaos.join(60)
    total = time.monotonic() - started
    fleet.check(chaos.error is None, f"the chaos thread failed: {chaos.error!r}")

    # Verify every round.
    failures: list[str] = []
    unfinished = [n.name for n in nodes if not n.events("done")]
    if unfinished:
        failures.append(f"{unfinished} were still in a round after {SOAK_TIMEOUT} s")
    by_round: dict[int, list[Event]] = {}
    for node in nodes:
        for e in node.events("error"):
            failures.append(f"+{e['t'] - started:.2f}s {node.name}: {e['message']}")
        for e in node.events("round"):
            by_round.setdefault(e["round"], []).append(e)
    # One checker over every node's recorded outcomes: unique ranks 0..3 and one
    # member list per round (each member at its rank, each member returned the
    # round), rounds that only go up, no member that gave up.
    failures += violations(from_fleet(nodes), complete=True)
    # The faults happened: as many as asked for, each one seen (its member was down).
    if len(chaos.faults) < MIN_FAULTS:
        failures.append(f"{len(chaos.faults)} faults injected, not {MIN_FAULTS}")
    failures += [f"a fault did not happen: {what}" for what in chaos.unseen]
    failures += [
        f"round {k}: {len(results)} results, not {NODES}"
        for k, results in sorted(by_round.items())
        if len(results) != NODES
    ]
    if len(by_round) < ROUNDS or sorted(by_round) != list(range(1, len(by_round) + 1)):
        failures.append(f"rounds {sorted(by_round)}: not 1..n with n >= {ROUNDS}")

    # Round time: from the previous round's last completion to this one's.
    ends = [max(r["t"] for r in by_round[k]) for k in sorted(by_round)]
    durations = [b - a for a, b in zip([started, *ends], ends, strict=False)]
    kinds = Counter(kind for _, kind, _, _ in chaos.faults)
    print(
        f"\nsoak[{api}] seed={seed}: {len(by_round)} rounds of {NODES} nodes in {total:.1f} s, "
        f"{len(failures)} failures, {len(chaos.faults)} faults {dict(kinds)}; "
        f"round time (s) {_summary(durations) if durations else 'n/a'}"
    )
    timeline = [
        f"+{t - started:.2f}s {kind} {where} for {d:.2f}s" for t, kind, where, d in chaos.faults
    ]
    fleet.check(
        not failures,
        f"{len(failures)} failures (seed {seed}): {failures[:10]}\nfaults: {timeline}",
    )
