"""Churn soak: at least 100 rounds while nodes are killed, exit and arrive.

Node processes behave as torch's agent does: after a round they poll
``num_nodes_waiting()`` and re-rendezvous when it turns positive. Meanwhile a chaos
loop changes the membership one step at a time: SIGKILL a node (seen when its key
expires), let a node exit without ``shutdown()`` (seen at once), or start a new node
(a waiting node while the group is below ``max_nodes``, a spare when it is full).
Between 2 and 5 nodes live at any time, with ``max_nodes=4``: spares come and go.

Every completed round is checked as every one of its members saw it: each member that
reported it reports the same member list and its own rank in it, ranks ``0..n-1``, one
per member, ``min_nodes <= n <= max_nodes``; and a member that did not report it was
killed or left by then (and reports no later round): a live member never misses a
round it is in.

Re-rendezvous are bounded per change, not on average: each round is charged to a
change that can cause one (a kill or an exit of a node that is not a spare, a start
while the group is below ``max_nodes``) made at most ``CHARGE_WINDOW`` seconds before
it, and no change is charged more than ``ROUNDS_PER_CHANGE`` rounds. A spare arriving
or leaving while the group is full causes none, and is charged none, so free changes
cannot dilute a storm elsewhere. ``ETCD_RDZV_SOAK_SEED`` replays a run's sequence
(the seed is printed).
"""

from __future__ import annotations

import os
import random
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from etcd_rdzv import RendezvousParameters
from etcd_rdzv.testing.history import from_fleet, violations
from fleet import Event, Fleet, Node

ROUNDS = 100  # at least this many completed rounds
MIN_NODES, MAX_NODES = 2, 4
LIVE = (2, 5)  # nodes alive at any time: up to one spare beside a full group
CHURN_TIMEOUT = 240.0  # seconds for all of it; a stuck run fails the test here
SETTLE = 8.0  # seconds for the last change to be absorbed before the rounds are checked
ROUNDS_PER_CHANGE = 2  # at most this many rounds come of one kill, exit or growing start
CHARGE_WINDOW = 12.0  # seconds after a change in which a round may come of it
MISSED_BY = 5.0  # seconds after a round's last report by which a silent member was gone

Params = Callable[..., RendezvousParameters]


@dataclass
class Change:
    """One membership change the chaos loop made (``t``: this host's monotonic clock,
    the clock of the nodes' events)."""

    t: float
    kind: str  # "kill", "leave" or "start"
    node: Node
    chargeable: bool = True  # it can cause a round: not a spare's arrival or departure
    charged: int = 0  # rounds charged to it


def _rounds(fleet: Fleet) -> dict[int, list[Event]]:
    by_round: dict[int, list[Event]] = defaultdict(list)
    for node in fleet.processes:
        for event in node.events("round"):
            by_round[int(event["round"])].append(event)
    return by_round


def _node_id(node: Node) -> str | None:
    """The node's id from its ``ready`` event (None: it never got ready)."""
    for event in node.events("ready"):
        details = event.get("details") or []
        if details and details[0].get("node_id"):
            return str(details[0]["node_id"])
    return None


def _check_round(
    round_no: int, events: list[Event], gone: dict[str, float], later: set[str]
) -> list[str]:
    """What is wrong with one round as every one of its members saw it. ``gone``: node
    id -> when it was killed or told to leave; ``later``: ids that reported a later
    round."""
    lists = {tuple(e["members"]) for e in events}
    if len(lists) != 1:
        return [f"round {round_no}: members disagree: {sorted(lists)}"]
    (members,) = lists
    n = len(members)
    if len(set(members)) != n or not MIN_NODES <= n <= MAX_NODES:
        return [f"round {round_no}: bad member list {members}"]
    problems = []
    reporters = [e["node_id"] for e in events]
    if len(set(reporters)) != len(reporters):
        problems.append(f"round {round_no}: a node reported it twice: {sorted(reporters)}")
    for e in events:
        if e["world_size"] != n or not 0 <= e["rank"] < n or members[e["rank"]] != e["node_id"]:
            problems.append(
                f"round {round_no}: {e['node_id']} has rank {e['rank']} of {e['world_size']} "
                f"in {members}"
            )
    last_report = max(e["t"] for e in events)
    for rank, node_id in enumerate(members):
        if node_id in reporters:
            continue
        gone_at = gone.get(node_id)
        if gone_at is None or gone_at > last_report + MISSED_BY or node_id in later:
            problems.append(
                f"round {round_no}: member {node_id} (rank {rank}) did not report it, though "
                f"{'alive' if gone_at is None else 'alive until later'}"
                f"{' and in a later round' if node_id in later else ''}"
            )
    return problems


def _charge(by_round: dict[int, list[Event]], changes: list[Change]) -> list[str]:
    """Charge each round (in the order they completed) to the earliest change before it,
    within CHARGE_WINDOW, that can still take one; what could not be charged."""
    problems = []
    for round_no, events in sorted(by_round.items(), key=lambda item: min(e["t"] for e in item[1])):
        done = min(e["t"] for e in events)
        payer = next(
            (
                c
                for c in changes
                if c.chargeable
                and c.t < done <= c.t + CHARGE_WINDOW
                and c.charged < ROUNDS_PER_CHANGE
            ),
            None,
        )
        if payer is None:
            recent = [
                f"{c.kind} {c.node.name}{'' if c.chargeable else ' (spare)'} x{c.charged}"
                for c in changes
                if c.t < done <= c.t + CHARGE_WINDOW
            ]
            problems.append(
                f"round {round_no}: no change of the {CHARGE_WINDOW:.0f} s before it can "
                f"take it (each at most {ROUNDS_PER_CHANGE}): {recent}"
            )
        else:
            payer.charged += 1
    return problems


def _classify(changes: list[Change], by_round: dict[int, list[Event]]) -> None:
    """Mark the changes a spare made (it arrived or left while the group was full, not
    being one of its members): those cause no round and pay for none."""
    completed = sorted((min(e["t"] for e in evs), evs[0]["members"]) for evs in by_round.values())
    for change in changes:
        before = [members for t, members in completed if t <= change.t]
        if not before or len(before[-1]) < MAX_NODES:
            continue  # no group yet, or one below max_nodes: a node can enlarge it
        if _node_id(change.node) not in before[-1]:
            change.chargeable = False


@pytest.mark.etcd_variants("v3")
def test_churn_soak(etcd_api_params: Params, tmp_path: Path) -> None:
    seed = int(os.environ.get("ETCD_RDZV_SOAK_SEED", random.randrange(10**8)))
    print(f"churn soak seed {seed} (ETCD_RDZV_SOAK_SEED={seed} replays it)")
    rng = random.Random(seed)
    params = etcd_api_params(
        "churn",
        min_nodes=MIN_NODES,
        max_nodes=MAX_NODES,
        # No last call: a restarting group re-forms as soon as all its survivors are
        # in (they are never out of both rounds), and a new node while the group is
        # below max_nodes brings the group together again at once.
        last_call_timeout=0,
        keep_alive_interval=1,
        keep_alive_max_attempt=2,
        join_timeout=60,
    )
    changes: list[Change] = []
    with Fleet(tmp_path, max_life=CHURN_TIMEOUT + 60) as fleet:
        live: list[Node] = []
        count = 0

        def start() -> None:
            nonlocal count
            node = fleet.start(f"n{count}", params)
            changes.append(Change(time.monotonic(), "start", node))
            count += 1
            node.join(0, agent=True, poll=0.1)
            live.append(node)

        for _ in range(5):
            start()
        started = time.monotonic()
        while len(_rounds(fleet)) < ROUNDS:
            if time.monotonic() - started > CHURN_TIMEOUT:
                pytest.fail(
                    f"only {len(_rounds(fleet))} rounds in {CHURN_TIMEOUT} s\n{fleet.describe(8)}"
                )
            time.sleep(rng.uniform(0.15, 0.8))
            live = [n for n in live if n.alive]
            kinds = ["kill", "leave"] if len(live) > LIVE[0] else []
            kinds += ["start"] if len(live) < LIVE[1] else []
            kind = rng.choice(kinds)
            if kind == "start":
                start()
            else:
                victim = rng.choice(live)
                at = time.monotonic()
                if kind == "kill":
                    victim.kill()
                else:
                    victim.send("leave")
                changes.append(Change(at, kind, victim))
                live.remove(victim)
        time.sleep(SETTLE)
        took = time.monotonic() - started
        by_round = _rounds(fleet)
        history = from_fleet(n for n in fleet.processes if isinstance(n, Node))

        # A node told to leave exits without shutdown(): a join it still ran is ended by
        # the handler's finalizer at exit, which is not an error of the rendezvous.
        def _errors(node: Node) -> list[Event]:
            left = min((e["t"] for e in node.events("exit")), default=float("inf"))
            return [e for e in node.events("error") if e["t"] < left]

        failed = [n for n in fleet.processes if isinstance(n, Node) and _errors(n)]
        errors = [(n.name, e["kinds"][0], e["message"]) for n in failed for e in _errors(n)]
        report = "\n".join(n.describe(40) for n in failed[:3]) or fleet.describe(8)
        gone = {
            node_id: c.t
            for c in changes
            if c.kind != "start" and (node_id := _node_id(c.node)) is not None
        }

    problems = []
    for round_no, events in sorted(by_round.items()):
        later = {e["node_id"] for r, evs in by_round.items() if r > round_no for e in evs}
        problems += _check_round(round_no, events, gone, later)
    # And the recorded history as a whole: rounds only go up, no member gave up.
    problems += violations(history, killed=gone)
    _classify(changes, by_round)
    storms = _charge(by_round, changes)
    kinds = {k: sum(1 for c in changes if c.kind == k) for k in ("kill", "leave", "start")}
    spares = sum(1 for c in changes if not c.chargeable)
    charged = [c.charged for c in changes if c.chargeable]
    sizes = [len(evs[0]["members"]) for _, evs in sorted(by_round.items())]
    print(
        f"churn: {len(by_round)} rounds in {took:.1f} s, {len(changes)} membership changes "
        f"({kinds}; {spares} by spares, which cost no round); rounds charged per other "
        f"change: max {max(charged, default=0)}, "
        f"{sum(1 for k in charged if k == 0)} x 0, {sum(1 for k in charged if k == 1)} x 1, "
        f"{sum(1 for k in charged if k >= 2)} x 2+; world sizes seen {sorted(set(sizes))}; "
        f"{count} node processes"
    )
    assert not problems, "\n".join(problems[:20])
    assert not errors, f"{errors[:10]}\n{report}"
    assert len(by_round) >= ROUNDS
    # Every round came of a change, and no change brought more than ROUNDS_PER_CHANGE.
    assert not storms, "\n".join(storms[:20])
