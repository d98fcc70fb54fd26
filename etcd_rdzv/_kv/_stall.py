"""Requests stuck behind a dead leader or a frozen member: found, and given up, within
seconds (both APIs).

A member forwards a proposal (a write, a lease grant) to its leader. If that leader
dies with it, the member answers only at etcd's own request timeout (5 s plus two
election timeouts: 7 s by default), long after a new leader was elected. An answer
carries the cluster's raft term (v3: every answer's header, watch messages too; v2:
the ``X-Raft-Term`` header of a result), and an election raises it. So a request that
waits looks, every :data:`LOOK` seconds, at the highest term this client's other
answers brought since it was sent (free); once the term went up, the request is given
up (:class:`Stalled`) and the failover loop sends it again after a short jittered
pause: a read or a plain write as it is, a conditional write through its read-back (it
may have landed). No request is given up before it waited :meth:`Terms.settle`
(:data:`SETTLE` seconds, or twice this client's average answer), nor unless the
cluster answers promptly at the new term (one of this client's answers came within
:data:`PROMPT` since, or its member, asked, answers its term within :data:`PROMPT`
with a leader): under load, elections come from busy members, and thousands of clients
that resent everything at each of them added the load that caused the next (measured:
4,096 nodes on a 3-member cluster here formed no round; a member behind a dead leader
answers its term at once).

Only a client with no other answer coming (none for a :meth:`Terms.patience`: a client
whose heart beats hears from the cluster every few seconds) asks its member for the
term (the API's own cheap request, answered without the leader: v3
``/v3/maintenance/status``, v2 a read of the root directory) once a request has waited
:meth:`Terms.patience`: twice as long as the slowest of this client's latest
:data:`KNOWN` answers took (:data:`ASK_KNOWN` seconds at least; :data:`ASK` before it
had that many), or four times as long as its answers take on average, whichever is
longer, and at most once per patience for all of the client's requests. A request that
waits far longer than any answer lately took is likely stuck; one that waits as long
as the slow ones did is likely queued by a loaded member. A loaded etcd, whose answers
all come late, is not asked more the slower it gets (measured: asking after one second
added three requests per node to a 1,024-node cold start on a 3-member cluster, and
made it slower; before 3 answers came, asking after 3 s let a leader kill cost the
1,024-node round more than the election + 3 s in 4 of 7 runs, after 2 s in none of 4;
at 4,096 nodes 2 s added 0.4 status requests per node, once the keep-alive stream no
longer asked a loaded cluster for its leader).

A member that freezes (a stopped process, a paused VM) causes no election: its
clients' requests would wait for their whole timeout (``read_timeout``, 60 s by
default; measured: a v2 round of two nodes whose first member froze did not form in
120 s). So, while a client's answers come within :data:`PROMPT` on average (not on a
loaded cluster, whose requests are waited for), a request that waited
:meth:`Terms.lost_after` (:data:`LOST`, or twice the patience) is given up as
:class:`Lost` (a lost answer: the next endpoint) when a later request of this client
was answered within :data:`PROMPT` meanwhile, or when its member, asked for its
term, answers within :data:`PROMPT`, or does not answer within :data:`LOST_ASK`
while another member does, or answers late (busy) but held it :data:`BUSY_MAX` times
that long. A busy member, and a cluster none of whose members answers, are waited
for otherwise (resending adds to the load; measured: at 4,096 nodes on v2, giving
up every request whose member did not answer within :data:`LOST_ASK` left 995 nodes
without a rank). This check needs no term: it covers a client's first requests too.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence

__all__ = [
    "ASK",
    "ASK_KNOWN",
    "BUSY_MAX",
    "KNOWN",
    "LOOK",
    "LOST",
    "LOST_ASK",
    "PROMPT",
    "SETTLE",
    "TAIL",
    "Ask",
    "Lost",
    "Stalled",
    "Terms",
    "number",
]

log = logging.getLogger(__name__)

#: Seconds between two looks of a waiting request at the term of this client's answers
#: (the first once it waited ``LOOK``, the next after its settle).
LOOK = 0.5
#: Seconds a request waits, at least, before its client asks the member for the term,
#: while the client knows too few of its answers' times (:data:`KNOWN`) to judge.
ASK = 2.0
#: Seconds a request waits, at least, before its client asks the member for the term,
#: once it knows how long its answers take: :data:`TAIL` times its slowest recent one.
ASK_KNOWN = 1.5
#: How many of a client's latest answers tell how long its answers take.
KNOWN = 3
#: Times the slowest of this client's :data:`KNOWN` latest answers a request waits
#: before it counts as stuck (an answer a loaded member queued is not).
TAIL = 2.0
#: Seconds a request waits, at least, before a higher term gives it up.
SETTLE = 1.0
#: Seconds within which a member must answer its term for a waiting request to be
#: given up: a member that does not is busy, and the request waits for it.
PROMPT = 0.5
#: Seconds a request waits, at least, before it may count as lost (see
#: :meth:`Terms.lost_after`): etcd answers every request within its own request
#: timeout (5 s plus two election timeouts: 7 s by default), with "request timed out"
#: if nothing else, so a request that waited longer was never seen by a working member.
LOST = 8.0
#: Seconds a member has to answer the question for its term when a request of this
#: client waited :meth:`Terms.lost_after` for it: one that does not, while another
#: member does, is frozen (a stopped process, a paused VM) or gone, and the request
#: goes to the next endpoint.
LOST_ASK = 2.0
#: How many times :meth:`Terms.lost_after` a member that answers, though late (a busy
#: one), may hold a request before it counts as lost anyway (measured: at 4,096 nodes,
#: on both APIs, one node's read of its roster bucket waited on a member that answered
#: others for 40 s, until the node's join deadline, and the round failed for it).
BUSY_MAX = 3
_SLOW = 4.0  # times this client's average answer: what waiting long means
_SLOW_MAX = 30.0  # seconds: the longest time between two asks of a busy member
_WEIGHT = 0.2  # of the newest answer in the moving average

#: How an API asks a member for its raft term: ``ask(url, headers, timeout)``, the
#: term if the member has a leader, else 0; it may raise (no answer: no verdict).
Ask = Callable[[str, dict[str, str], float], int]


class Stalled(OSError):
    """The cluster elected a new leader while a request waited for its answer: the
    request may have gone to the old one, and then would be answered only at etcd's
    request timeout. The failover loop treats it as a transient error (send again)."""


class Lost(OSError):
    """A request waited :meth:`Terms.lost_after` for its answer, and either a later
    request of this client was answered promptly meanwhile, or its member did not
    answer a question within :data:`LOST_ASK` while another one did (frozen, or
    gone), or answered it at once (with a leader or without one), or the request
    waited over :data:`BUSY_MAX` times :meth:`Terms.lost_after` however its member
    answered: the request was lost, or is held by a member that does not serve it.
    The failover loop treats it as a lost answer: the next endpoint (a write through
    its read-back, as it may have landed)."""


def number(value: object) -> int:
    """A raft term or member id as etcd sends it (decimal text or bytes, or a number);
    0 if it is none of those."""
    if isinstance(value, int) and not isinstance(value, bool):
        return max(value, 0)
    if isinstance(value, bytes):
        value = value.decode("latin-1")
    if isinstance(value, str) and value.isascii() and value.isdigit() and len(value) <= 20:
        return int(value)
    return 0


class Terms:
    """The highest raft term one client's answers carried, and the check that gives
    up on a request sent before an election.

    Args:
        ask: how to ask a member for its term (:data:`Ask`).
        urls: the base URLs of every endpoint of the client: a member that does not
            answer counts as frozen only while another one does.
    """

    def __init__(self, ask: Ask, urls: Sequence[str] = ()) -> None:
        self._ask_member = ask
        self._urls = list(urls)
        self.term = 0  # 0: none seen yet (no check: nothing to compare with)
        self._lock = threading.Lock()
        self._asked_at = -math.inf  # when a member was last asked for the term
        self._prompt = False  # whether it answered within PROMPT, with a leader
        self._busy = False  # whether it answered later than that, with a leader
        self._slow_for = 0.0  # seconds between asks while the member is busy (doubling)
        self._latency: float | None = None  # the moving average of answers, seconds
        self._recent: deque[float] = deque(maxlen=KNOWN)  # the latest answers' seconds
        self._prompt_term = 0  # the term known at this client's last prompt answer
        self._heard = -math.inf  # when this client's last answer came
        self._heard_term = 0  # the term known then
        self._prompt_sent = -math.inf  # when the latest-sent prompt answer's request was sent

    def note(self, term: int) -> None:
        """Note the raft term of an answer (0: it had none)."""
        self.term = max(self.term, term)

    def took(self, seconds: float) -> None:
        """Note how long a request took to be answered (its term noted already, or by
        the next answer): an answer within :data:`PROMPT` tells that the cluster
        answers at the term known now."""
        latency = self._latency
        self._latency = seconds if latency is None else latency + (seconds - latency) * _WEIGHT
        self._recent.append(seconds)
        now = time.monotonic()
        self._heard, self._heard_term = now, self.term
        if seconds <= PROMPT:
            self._prompt_sent = max(self._prompt_sent, now - seconds)
        if seconds <= PROMPT:
            self._prompt_term = max(self._prompt_term, self.term)

    @property
    def answer_time(self) -> float:
        """Seconds this client's answers lately took: the slowest of its
        :data:`KNOWN` latest ones (0.0 before any came)."""
        return max(self._recent, default=0.0)

    @property
    def settle(self) -> float:
        """Seconds a request waits, at least, before a new term gives it up: twice as
        long as this client's answers take on average, and :data:`SETTLE` at least."""
        return max(SETTLE, (self._latency or 0.0) * 2)

    @property
    def prompt(self) -> bool:
        """Whether the cluster answers this client promptly: each of its
        :data:`KNOWN` latest answers came within :data:`PROMPT` (``False`` before
        it had that many)."""
        recent = self._recent
        return len(recent) >= KNOWN and max(recent) <= PROMPT

    @property
    def patience(self) -> float:
        """Seconds a request waits before its client asks the member for the term:
        :data:`TAIL` times the slowest of this client's :data:`KNOWN` latest answers,
        four times their average, and :data:`ASK_KNOWN` at least; :data:`ASK` while
        fewer answers came. A request that waits far longer than any answer lately
        took is likely stuck; one that waits as long as the slow ones did is likely
        queued by a loaded member (asking then is load of its own: thousands of
        clients do it at once)."""
        recent = self._recent
        if len(recent) < KNOWN:
            return max(ASK, (self._latency or 0.0) * _SLOW)
        return max(ASK_KNOWN, TAIL * max(recent), (self._latency or 0.0) * _SLOW)

    @property
    def lost_after(self) -> float:
        """Seconds a request waits before it may count as lost: :data:`LOST`, and
        twice the :meth:`patience` at least (a loaded etcd, whose answers all come
        late, is given time in proportion)."""
        return max(LOST, 2 * self.patience)

    def checker(
        self, url: str, headers: dict[str, str], what: str, deadline: float | None = None
    ) -> Callable[[], float]:
        """The check for a request of ``what`` to ``url`` sent now (to be answered by
        ``deadline``, a ``time.monotonic()`` instant, if given), to be called while it
        waits: first :data:`LOOK` seconds after it was sent, then when the check last
        returned (seconds). A request that waits long (thousands of them, on a loaded
        etcd) is looked at every :data:`LOOK` seconds once it waited :meth:`settle`,
        not before; a request sent before any term was known only when it may count
        as lost (:meth:`lost_after`).

        Raises (from the check):
            Lost: see :class:`Lost`, once it waited :meth:`lost_after`.
            Stalled: see the module.
        """
        sent = self.term
        began = time.monotonic()
        lost_at = began + self.lost_after

        def check() -> float:
            nonlocal lost_at
            now = time.monotonic()
            waited = now - began
            if now >= lost_at:
                # Judged once per lost_after: a busy member's request waits on.
                lost_at = now + self.lost_after
                if (self._latency or 0.0) <= PROMPT:
                    # Only while this client's answers come promptly on average: a
                    # loaded cluster's requests are waited for, however long (each
                    # sent again is load of its own; measured: at 4,096 nodes, v3
                    # runs that judged them too left 1 and 36 nodes without a rank,
                    # their roster reads held by one member after another).
                    self._judge_lost(url, headers, what, began, waited, deadline)
            if not sent:
                return max(lost_at - time.monotonic(), LOOK)
            settle = self.settle
            if waited < settle:
                # Too soon to give up on it: a new leader answers in this time what
                # reached it, and under load (where elections come from busy members)
                # thousands of clients resending at each election pile on.
                return settle - waited
            seen = self.term
            if seen > sent and self._prompt_term > sent:
                # An answer came within PROMPT since the election (a heartbeat's, say):
                # the cluster answers again, and this request is stuck. No question.
                raise Stalled(
                    f"the etcd cluster elected a new leader (raft term {sent} -> {seen}, "
                    "seen in this client's answers, which come promptly again) while "
                    f"{what} waited {waited:.1f}s for its answer; sending it again"
                )
            if seen <= sent and waited < self.patience:
                return LOOK
            if time.monotonic() - self._heard < self.patience and self._heard_term >= seen:
                # Answers come to this client (its heart's, say) at the term known now,
                # and each tells whether the cluster answers promptly at it: what asking
                # would tell, without the question. (Measured: at 4,096 nodes, waiting
                # requests that asked at every election sent 5.8 status requests per
                # node in a round with ten elections.)
                return LOOK
            if (self._latency or 0.0) > PROMPT:
                # This client's answers come late: a loaded cluster, whose members would
                # answer a question late too (thousands of clients asking are load of
                # their own). Its answers bring the term; wait for them.
                return LOOK
            # A new term in this client's answers, or a long wait: is the member's own
            # answer prompt, with a leader at a higher term? Only then is the request
            # stuck behind a leader that is gone; a member too busy to answer within
            # PROMPT is one the request waits for (an election under load).
            term, prompt = self._ask(url, headers)
            if prompt and term > sent:
                source = (
                    "in this client's answers" if seen > sent else f"in {url}'s answer when asked"
                )
                raise Stalled(
                    f"the etcd cluster elected a new leader (raft term {sent} -> {term}, "
                    f"seen {source}; {url} answers promptly) while {what} waited "
                    f"{waited:.1f}s for its answer; sending it again"
                )
            return LOOK

        return check

    def _judge_lost(
        self,
        url: str,
        headers: dict[str, str],
        what: str,
        began: float,
        waited: float,
        deadline: float | None,
    ) -> None:
        """Raise :class:`Lost` if the request sent at ``began`` to ``url`` is lost
        (see there); return if it waits for a busy member (asked now, or found busy
        by a question within the last :meth:`patience`, as :meth:`_ask` would)."""
        if self._prompt_sent > began:
            raise Lost(
                f"{what} had no answer from {url} after {waited:.1f}s while later requests "
                "of this client were answered promptly: it is lost; sending it to the next "
                "endpoint"
            )
        ask = LOST_ASK
        if deadline is not None:
            ask = min(ask, deadline - time.monotonic())
            if ask < PROMPT:
                return  # the request ends by its deadline before an answer could tell
        if not self._lock.acquire(blocking=False):
            return  # another request is asking; this one is judged again later
        try:
            held = waited >= BUSY_MAX * self.lost_after  # longer than a busy member may
            if (
                not held
                and self._busy
                and time.monotonic() - self._asked_at < max(self.patience, self._slow_for)
            ):
                return  # found busy lately: asking again is load of its own
            term, took = self._question(url, headers, ask)
        finally:
            self._lock.release()
        if took is None:
            # Frozen, or loaded like the rest of the cluster? Only another member's
            # answer tells (measured: at 4,096 nodes on v2, requests given up whenever
            # their loaded member did not answer within LOST_ASK, each sent again and
            # read back, left 995 nodes without a rank at the join deadline).
            if deadline is not None:
                ask = min(ask, deadline - time.monotonic())
                if ask < PROMPT:
                    return  # no time left to ask another: its own timeout ends it
            other = self._answering_other(url, headers, ask)
            if other is None:
                return  # no other member answers either: wait, as for a busy one
            raise Lost(
                f"{what} had no answer from {url} after {waited:.1f}s, and {url} did not "
                f"answer a question for its raft term within {ask:.1f}s while {other} "
                "did: a frozen or lost member; sending it to the next endpoint"
            )
        if term and took > PROMPT and not held:
            return  # a busy member, with a leader: the request waits its turn
        state = f"raft term {term}, a leader" if term else "no leader"
        why = f" (over {BUSY_MAX} times {self.lost_after:.1f}s)" if held else ""
        raise Lost(
            f"{what} had no answer from {url} after {waited:.1f}s{why}, though {url} "
            f"answers a question for its raft term in {took:.2f}s ({state}): it is lost; "
            "sending it to the next endpoint"
        )

    def _answering_other(self, url: str, headers: dict[str, str], timeout: float) -> str | None:
        """Another endpoint of the client that answers a question for its term within
        ``timeout``, asked now (the first one but ``url``); ``None`` if it does not, or
        there is none."""
        other = next((u for u in self._urls if u != url), None)
        if other is None:
            return None
        try:
            self._ask_member(other, headers, timeout)
        except Exception as exc:  # no answer there either
            log.debug("the raft term of %s, asked about a silent %s: %s", other, url, exc)
            return None
        return other

    def _ask(self, url: str, headers: dict[str, str]) -> tuple[int, bool]:
        """The term known after asking the member, and whether it answered within
        :data:`PROMPT` with a leader. At most one request per :meth:`patience` for all
        of this client's waiting requests: in between, the last answer's verdict."""
        if not self._lock.acquire(blocking=False):
            return self.term, False  # another request is asking
        try:
            if time.monotonic() - self._asked_at < max(self.patience, self._slow_for):
                return self.term, self._prompt
            self._question(url, headers, PROMPT)
            return self.term, self._prompt
        finally:
            self._lock.release()

    def _question(
        self, url: str, headers: dict[str, str], timeout: float
    ) -> tuple[int, float | None]:
        """Ask the member at ``url`` for its term (the lock held), within ``timeout``:
        its answer (0: no leader) and the seconds it took (``None``: no answer)."""
        self._asked_at = asked = time.monotonic()
        self._prompt = self._busy = False
        took: float | None = None
        try:
            term = self._ask_member(url, headers, timeout)
            took = time.monotonic() - asked
        except Exception as exc:  # no answer is no verdict
            log.debug("the raft term of %s, for a waiting request: %s", url, exc)
            term = 0
        self.note(term)
        self._prompt = term > 0 and took is not None and took <= PROMPT
        self._busy = term > 0 and took is not None and took > PROMPT
        # A busy member is asked less and less often (thousands of waiting clients
        # asking every few seconds are load of their own), a prompt one as before.
        self._slow_for = 0.0 if self._prompt else min(max(2 * self._slow_for, ASK), _SLOW_MAX)
        return term, took
