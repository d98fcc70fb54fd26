"""The stall check's pure parts (no server): when a waiting request is given up, and
how often a client asks its member for the raft term (never more than once per
patience, however many requests wait; less often the slower etcd answers)."""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Callable

import pytest

from etcd_rdzv._kv import _stall
from etcd_rdzv._kv._stall import KNOWN, PROMPT, Lost, Stalled, Terms, number


class _Member:
    """What an API's ask returns: a term, counted."""

    def __init__(self, term: int) -> None:
        self.term = term
        self.asked = 0

    def __call__(self, url: str, headers: dict[str, str], timeout: float) -> int:
        self.asked += 1
        return self.term


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> _Clock:
    found = _Clock()
    monkeypatch.setattr(time, "monotonic", found)  # the module reads time.monotonic()
    return found


def _checker(terms: Terms, what: str = "PUT /k") -> Callable[[], None]:
    check = terms.checker("http://m", {}, what)
    assert check is not None
    return check


def test_before_a_term_is_known_a_request_is_only_judged_lost(clock: _Clock) -> None:
    # A client's first request has no term to compare: no question until it waited
    # lost_after, and then only whether it is lost.
    member = _Member(5)
    terms = Terms(member)
    check = _checker(terms)
    assert check() == pytest.approx(_stall.LOST)  # nothing to look at before then
    clock.now += _stall.LOST - 0.1
    check()
    assert member.asked == 0
    clock.now += 0.1
    with pytest.raises(Lost, match=r"answers a question for its raft term in 0.00s"):
        check()
    assert member.asked == 1


def test_a_higher_term_in_another_answer_gives_the_request_up(clock: _Clock) -> None:
    member = _Member(7)
    terms = Terms(member)
    terms.note(7)
    check = _checker(terms)
    check()  # the same term: nothing
    terms.note(8)
    check()  # a new term, but too soon to give the request up (it may be answered)
    clock.now += _stall.SETTLE
    member.term = 8
    with pytest.raises(Stalled, match=r"raft term 7 -> 8, seen in this client's answers"):
        check()
    assert member.asked == 1  # the member answered at once: not a busy one


class _Busy(_Member):
    """A member whose answer takes longer than PROMPT (a loaded one)."""

    def __init__(self, term: int, clock: _Clock) -> None:
        super().__init__(term)
        self.clock = clock

    def __call__(self, url: str, headers: dict[str, str], timeout: float) -> int:
        self.clock.now += _stall.PROMPT + 0.1
        return super().__call__(url, headers, timeout)


def test_a_new_term_does_not_give_a_request_up_while_the_member_is_busy(clock: _Clock) -> None:
    # Under load elections come from busy members: a request there waits for its
    # answer (or etcd's own timeout) instead of being sent again by every client.
    member = _Busy(8, clock)
    terms = Terms(member)
    terms.note(7)
    check = _checker(terms)
    terms.note(8)
    for _ in range(40):
        clock.now += _stall.LOOK
        check()
    assert member.asked >= 1


def test_a_request_is_given_up_no_sooner_than_twice_the_usual_answer(clock: _Clock) -> None:
    # Under load (answers take 2 s) a new term gives up a request only after twice
    # the usual answer: elections come from busy members there, and resending
    # everything adds load.
    terms = Terms(_Member(7))
    terms.note(7)
    for _ in range(30):
        terms.took(2.0)
    check = _checker(terms)
    terms.note(8)
    terms.took(0.1)  # a prompt answer at the new term; the average is 1.6 s now
    assert terms.settle == pytest.approx(3.24, abs=0.01)
    clock.now += 3.2
    check()
    clock.now += 0.1
    with pytest.raises(Stalled):
        check()


def test_the_member_is_asked_after_the_patience_and_once_per_patience(clock: _Clock) -> None:
    member = _Member(3)  # no election yet
    terms = Terms(member)
    terms.note(3)
    checks = [_checker(terms, f"PUT /k{i}") for i in range(50)]
    for _ in range(int(_stall.ASK / _stall.LOOK)):
        clock.now += _stall.LOOK
        for check in checks:
            check()
    assert member.asked == 1  # 50 waiting requests, one question
    clock.now += _stall.ASK / 2
    for check in checks:
        check()
    assert member.asked == 1  # not again within the patience
    member.term = 4  # elected meanwhile
    clock.now += _stall.ASK / 2
    with pytest.raises(Stalled, match=r"raft term 3 -> 4, seen in http://m's answer when asked"):
        checks[0]()
    assert member.asked == 2
    for check in checks[1:]:  # the others see the term the question brought
        with pytest.raises(Stalled):
            check()
    assert member.asked == 2


def test_a_slow_etcd_is_not_asked_its_answers_bring_the_term(clock: _Clock) -> None:
    # Every answer takes two seconds: a loaded cluster, whose members would answer a
    # question late too (and thousands of clients asking are load of their own).
    member = _Member(3)
    terms = Terms(member)
    terms.note(3)
    for _ in range(50):
        terms.took(2.0)
    assert terms.patience == pytest.approx(8.0)
    check = _checker(terms)
    assert terms.lost_after == pytest.approx(16.0)  # twice the patience
    for _ in range(30):  # 15 s: not yet lost, and no question
        clock.now += _stall.LOOK
        check()
    assert member.asked == 0
    # Its answers bring a newer term, but late: the request waits on.
    terms.note(4)
    terms.took(2.0)
    check()
    # A prompt answer at that term (a heartbeat's): the cluster answers again.
    terms.took(0.1)
    with pytest.raises(Stalled, match="which come promptly again"):
        check()
    assert member.asked == 0


def test_no_answer_to_the_question_is_no_verdict(clock: _Clock) -> None:
    def fails(url: str, headers: dict[str, str], timeout: float) -> int:
        raise TimeoutError("no answer")

    terms = Terms(fails)
    terms.note(3)
    check = _checker(terms)
    clock.now += _stall.ASK
    check()  # nothing raised: the request waits on


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("12", 12),
        (b"12", 12),
        (12, 12),
        ("", 0),
        ("-1", 0),
        ("1e3", 0),
        (True, 0),
        (None, 0),
        ("9" * 21, 0),
        ("١٢", 0),
        (-4, 0),
    ],
)
def test_a_term_from_etcd_is_read_strictly(value: object, expected: int) -> None:
    assert number(value) == expected


def test_a_busy_member_is_asked_less_and_less_often(
    clock: _Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_stall, "BUSY_MAX", 100)  # the request waits on (see below)
    member = _Busy(8, clock)
    terms = Terms(member)
    terms.note(7)
    check = _checker(terms)
    terms.note(8)
    asked_at = []
    for _ in range(int(120 / _stall.LOOK)):
        clock.now += _stall.LOOK
        before = member.asked
        check()
        if member.asked > before:
            asked_at.append(clock.now)
    gaps = [b - a for a, b in itertools.pairwise(asked_at)]
    assert gaps == sorted(gaps) and gaps[-1] >= 29, gaps  # 3, 6, 12, 24, 30 s ...
    assert len(asked_at) <= 8, asked_at  # not 40 (every 3 s for two minutes)


def test_a_client_that_hears_answers_at_the_known_term_does_not_ask(clock: _Clock) -> None:
    # A node whose heart beats hears from the cluster every few seconds: each answer
    # brings its term and whether it came promptly, which is what asking would tell.
    # At 4,096 nodes with ten elections, asking anyway cost 5.8 requests per node.
    member = _Member(8)
    terms = Terms(member)
    terms.note(7)
    terms.took(0.05)
    check = _checker(terms)
    # (Within lost_after, 8 s here: a request that waits longer while later ones are
    # answered is lost, see below.)
    for _ in range(3):  # 3 s of a request that waits; a prompt answer every second
        for _ in range(2):
            clock.now += _stall.LOOK
            check()
        terms.took(0.1)  # at term 7
    assert member.asked == 0
    terms.note(8)  # an election, seen in a slow answer
    terms.took(0.6)
    for _ in range(2):  # slow answers at term 8 (a loaded cluster): no question
        for _ in range(2):
            clock.now += _stall.LOOK
            check()
        terms.took(0.6)
    assert member.asked == 0
    # Silence: no answer for a patience. Now the member is asked, and its prompt
    # answer at the new term gives the request up.
    clock.now += terms.patience + _stall.LOOK
    with pytest.raises(Stalled, match=r"raft term 7 -> 8, seen in this client's answers"):
        check()
    assert member.asked == 1


def test_a_new_term_seen_without_an_answer_at_it_is_asked_about(clock: _Clock) -> None:
    # The new term came in a watch message (no answer timed at it): the client has
    # heard nothing at that term, so its member is asked once the request settled.
    member = _Member(8)
    terms = Terms(member)
    terms.note(7)
    terms.took(0.05)
    check = _checker(terms)
    terms.note(8)
    clock.now += _stall.SETTLE
    with pytest.raises(Stalled, match=r"raft term 7 -> 8"):
        check()
    assert member.asked == 1


def _asked_after(terms: Terms, member: _Member, clock: _Clock, limit: float) -> float | None:
    """Seconds a request waits, with no other answer coming, until its member is
    asked (None: not within ``limit``)."""
    check = _checker(terms)
    began = clock.now
    while clock.now - began < limit:
        clock.now += _stall.LOOK / 5
        with contextlib.suppress(Stalled):
            check()
        if member.asked:
            return clock.now - began
    return None


def test_a_client_whose_answers_are_quick_asks_sooner(clock: _Clock) -> None:
    # A leader killed mid-round: a request stuck behind it is found after twice the
    # slowest of the client's latest answers (ASK_KNOWN at least), not after ASK.
    member = _Member(3)
    terms = Terms(member)
    terms.note(3)
    for _ in range(_stall.KNOWN):
        terms.took(0.05)
        clock.now += 0.1
    clock.now += 10  # nothing heard since
    assert terms.patience == pytest.approx(_stall.ASK_KNOWN)
    waited = _asked_after(terms, member, clock, 10)
    assert waited is not None
    assert _stall.ASK_KNOWN <= waited < _stall.ASK_KNOWN + 0.2


def test_a_client_that_saw_a_slow_answer_lately_waits_longer_before_asking(
    clock: _Clock,
) -> None:
    # A loaded member queued one of the latest answers for 2.5 s: a request that waits
    # as long is likely queued too, and thousands of clients asking are load of their
    # own. The client asks after twice that slow answer.
    member = _Member(3)
    terms = Terms(member)
    terms.note(3)
    for _ in range(20):
        terms.took(0.05)
    terms.took(2.5)
    for _ in range(_stall.KNOWN - 1):
        terms.took(0.05)
    clock.now += 10
    assert terms.patience == pytest.approx(_stall.TAIL * 2.5)
    waited = _asked_after(terms, member, clock, 20)
    assert waited is not None and waited >= _stall.TAIL * 2.5, waited


def test_a_client_with_too_few_answers_asks_after_ask(clock: _Clock) -> None:
    member = _Member(3)
    terms = Terms(member)
    terms.note(3)
    for _ in range(_stall.KNOWN - 1):
        terms.took(0.05)
    clock.now += 10
    assert terms.patience == pytest.approx(_stall.ASK)
    waited = _asked_after(terms, member, clock, 10)
    assert waited is not None and _stall.ASK <= waited < _stall.ASK + 0.2, waited


def test_prompt_means_the_latest_known_answers_all_came_within_prompt() -> None:
    """What the keep-alive stream asks before it looks for the leader: a loaded
    cluster (one late answer among the latest KNOWN) is not asked."""
    terms = Terms(_Member(5))
    assert not terms.prompt  # nothing known yet
    for _ in range(KNOWN - 1):
        terms.took(PROMPT / 2)
    assert not terms.prompt  # too few answers to judge
    terms.took(PROMPT / 2)
    assert terms.prompt
    terms.took(PROMPT * 2)
    assert not terms.prompt  # one late answer among the latest
    for _ in range(KNOWN - 1):
        terms.took(PROMPT / 2)
    assert not terms.prompt
    terms.took(PROMPT)
    assert terms.prompt  # the late one is no longer among the latest KNOWN


def test_a_request_that_waits_while_later_ones_are_answered_is_lost(clock: _Clock) -> None:
    # Its member answers this client's other requests (a heartbeat's, every second)
    # but not this one: lost (etcd answers each request within its own timeout, 7 s
    # by default). It goes to the next endpoint once it waited lost_after, unasked.
    member = _Member(3)
    terms = Terms(member)
    terms.note(3)
    check = _checker(terms)
    began = clock.now
    with pytest.raises(Lost, match=r"later requests of this client were answered") as caught:
        while clock.now - began < 60:
            clock.now += _stall.LOOK
            check()
            if (clock.now - began) % 1.0 == 0:
                terms.took(0.05)
    assert clock.now - began == pytest.approx(_stall.LOST)
    assert member.asked == 0
    assert isinstance(caught.value, OSError)  # a lost answer to the failover loop


def test_a_frozen_member_loses_the_request_a_busy_one_keeps_it(clock: _Clock) -> None:
    asked: list[str] = []

    def frozen_m(url: str, headers: dict[str, str], timeout: float) -> int:
        asked.append(url)
        if url == "http://m":  # frozen: no answer
            clock.now += timeout
            raise TimeoutError("timed out")
        return 3  # the other member answers at once

    terms = Terms(frozen_m, ["http://m", "http://n"])
    terms.note(3)
    check = _checker(terms)
    clock.now += _stall.LOST
    with pytest.raises(Lost, match=r"within 2.0s while http://n did: a frozen or lost member"):
        check()
    assert asked == ["http://m", "http://n"]

    busy = _Busy(3, clock)  # answers in 0.6 s, with a leader: the request waits on
    terms = Terms(busy, ["http://m", "http://n"])
    terms.note(3)
    check = _checker(terms)
    began = clock.now
    held = _stall.BUSY_MAX * terms.lost_after
    while clock.now - began < held - 1:
        clock.now += _stall.LOOK
        check()
    assert 1 <= busy.asked <= 5  # the back-off of a busy member (3, 6, 12 s ...)
    # But not for ever: one that holds a request BUSY_MAX times lost_after lost it.
    with pytest.raises(Lost, match=r"over 3 times 8.0s"):
        while clock.now - began < held + terms.lost_after:
            clock.now += _stall.LOOK
            check()


def test_a_request_waits_on_while_no_member_answers(clock: _Clock) -> None:
    # A loaded cluster: neither its member nor another one answers within LOST_ASK.
    # Sending the request again would add to the load (at 4,096 nodes on v2 it left
    # 995 nodes without a rank): it waits, judged again after another lost_after.
    asked: list[str] = []

    def silent(url: str, headers: dict[str, str], timeout: float) -> int:
        asked.append(url)
        clock.now += timeout
        raise TimeoutError("timed out")

    terms = Terms(silent, ["http://m", "http://n"])
    terms.note(3)
    check = _checker(terms)
    for _ in range(int(30 / _stall.LOOK)):
        clock.now += _stall.LOOK
        check()
    assert "http://n" in asked  # asked, and silent too: no verdict against m
    # Nowhere else to go: one endpoint only.
    alone = Terms(silent)
    alone.note(3)
    check = _checker(alone)
    clock.now += _stall.LOST
    check()


def test_slow_later_answers_do_not_make_a_request_lost(clock: _Clock) -> None:
    # Under load, later requests are answered (a read, say) while a write waits: only
    # a prompt later answer tells that its member serves this client but not it.
    member = _Busy(3, clock)
    terms = Terms(member, ["http://m", "http://n"])
    terms.note(3)
    check = _checker(terms)
    began = clock.now
    while clock.now - began < _stall.BUSY_MAX * terms.lost_after - 1:
        clock.now += _stall.LOOK
        check()
        if (clock.now - began) % 1.0 == 0:
            terms.took(1.0)


def test_a_request_near_its_deadline_is_not_judged_lost(clock: _Clock) -> None:
    member = _Member(3)
    terms = Terms(member)
    terms.note(3)
    check = terms.checker("http://m", {}, "PUT /k", deadline=clock.now + _stall.LOST + 0.3)
    clock.now += _stall.LOST
    check()  # 0.3 s left: its own timeout ends it; not lost (the member answers at once)


def test_a_loaded_clients_requests_are_not_judged_lost(clock: _Clock) -> None:
    # Its answers take a second on average: a loaded cluster, whose requests are
    # waited for (at 4,096 nodes, judging them too left nodes without a rank).
    member = _Member(3)
    terms = Terms(member, ["http://m", "http://n"])
    terms.note(3)
    for _ in range(10):
        terms.took(1.0)
    check = _checker(terms)
    began = clock.now
    while clock.now - began < 120:
        clock.now += _stall.LOOK
        check()
    assert member.asked == 0
