"""Churn soak: at least 100 rounds while nodes are killed, exit and arrive.

Node processes behave as torch's agent does: after a round they poll
``num_nodes_waiting()`` and re-rendezvous when it turns positive. Meanwhile a chaos
loop changes the membership one step at a time: SIGKILL a node (seen when its key
expires), let a node exit without ``shutdown()`` (seen at once), or start a new node
(a waiting node while the group is below ``max_nodes``, a spare when it is full).
Between 2 and 5 nodes live at any time, with ``max_nodes=4``: spares come and go.

Every completed round must have one member list that all its reporting members agree
on, ranks ``0..n-1``, one per member, and ``min_nodes <= n <= max_nodes``. The number
of rounds per membership change is printed: a change should cost one re-rendezvous,
not a storm (the test asserts at most two on average). ``ETCD_RDZV_SOAK_SEED``
replays a run's sequence (the seed is printed).
"""

from __future__ import annotations

import os
import random
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import pytest

from etcd_rdzv import RendezvousParameters
from etcd_rdzv.testing.fleet import Event, Fleet, Node

ROUNDS = 100  # at least this many completed rounds
MIN_NODES, MAX_NODES = 2, 4
LIVE = (2, 5)  # nodes alive at any time: up to one spare beside a full group
CHURN_TIMEOUT = 240.0  # seconds for all of it; a stuck run fails the test here
SETTLE = 8.0  # seconds for the last change to be absorbed before the rounds are checked

Params = Callable[..., RendezvousParameters]


def _rounds(fleet: Fleet) -> dict[int, list[Event]]:
    by_round: dict[int, list[Event]] = defaultdict(list)
    for node in fleet.processes:
        for event in node.events("round"):
            by_round[int(event["round"])].append(event)
    return by_round


def _check_round(round_no: int, events: list[Event]) -> str | None:
    """What is wrong with one round as its members reported it (None: nothing)."""
    lists = {tuple(e["members"]) for e in events}
    if len(lists) != 1:
        return f"round {round_no}: members disagree: {sorted(lists)}"
    (members,) = lists
    n = len(members)
    if len(set(members)) != n or not MIN_NODES <= n <= MAX_NODES:
        return f"round {round_no}: bad member list {members}"
    for e in events:
        if e["world_size"] != n or members[e["rank"]] != e["node_id"]:
            return f"round {round_no}: {e['node_id']} has rank {e['rank']} of {e['world_size']}"
    if len({e["rank"] for e in events}) != len(events):
        return f"round {round_no}: a rank reported twice"
    return None


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
    changes: list[tuple[float, str]] = []
    with Fleet(tmp_path, max_life=CHURN_TIMEOUT + 60) as fleet:
        live: list[Node] = []
        count = 0

        def start() -> None:
            nonlocal count
            node = fleet.start(f"n{count}", params)
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
                if kind == "kill":
                    victim.kill()
                else:
                    victim.send("leave")
                live.remove(victim)
            changes.append((time.monotonic() - started, kind))
        time.sleep(SETTLE)
        took = time.monotonic() - started
        by_round = _rounds(fleet)

        # A node told to leave exits without shutdown(): a join it still ran is ended by
        # the handler's finalizer at exit, which is not an error of the rendezvous.
        def _errors(node: Node) -> list[Event]:
            left = min((e["t"] for e in node.events("exit")), default=float("inf"))
            return [e for e in node.events("error") if e["t"] < left]

        failed = [n for n in fleet.processes if isinstance(n, Node) and _errors(n)]
        errors = [(n.name, e["kinds"][0], e["message"]) for n in failed for e in _errors(n)]
        report = "\n".join(n.describe(40) for n in failed[:3]) or fleet.describe(8)

    problems = [p for r, evs in sorted(by_round.items()) if (p := _check_round(r, evs))]
    kinds = {k: sum(1 for _, c in changes if c == k) for k in ("kill", "leave", "start")}
    per_change = len(by_round) / len(changes)
    sizes = [len(evs[0]["members"]) for _, evs in sorted(by_round.items())]
    print(
        f"churn: {len(by_round)} rounds in {took:.1f} s, {len(changes)} membership changes "
        f"({kinds}), {per_change:.2f} rounds per change; world sizes seen "
        f"{sorted(set(sizes))}; {count} node processes"
    )
    assert not problems, "\n".join(problems[:20])
    assert not errors, f"{errors[:10]}\n{report}"
    assert len(by_round) >= ROUNDS
    # One re-rendezvous per change, not a storm: a start while the group is full (a
    # spare) costs none, a kill or an exit one, a burst of changes may share one.
    assert per_change <= 2.0, f"{per_change:.2f} rounds per membership change: a storm"
