"""The guard of a running round: once the round is broken (a member gone), it cuts
this process's connections of the round's process group, so that a collective
blocked on a frozen peer fails at once instead of at the group's timeout.

Whether the round is broken comes from the handler's in-memory counts, kept by its
member watcher (no etcd request): :func:`round_broken` decides from them. The guard
polls them every ``interval`` seconds in a daemon thread and stops for good after it
fired once, or when :meth:`Guard.stop` is called.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

__all__ = ["INTERVAL", "Guard", "round_broken"]

log = logging.getLogger(__name__)

#: Seconds between two looks at the handler's counts (no request: a lock and a few
#: integers).
INTERVAL = 0.05


def round_broken(world_size: int, waiting: int, live_peers: int) -> bool:
    """Whether a round of ``world_size`` members is broken, from the handler's
    ``num_nodes_waiting()`` and ``live_peers()``: a member's key is gone (it died,
    froze past its lease, left or moved to the next round). Nodes that only wait to
    join (a scale-up) do not break it; nor does a closed run (``waiting`` is then 0:
    a member that finished first closed it)."""
    return waiting > 0 and live_peers < world_size - 1


class Guard:
    """Watches one round; calls ``on_broken`` once (in its thread) when it breaks.

    ``counts`` returns ``(num_nodes_waiting, live_peers)``; an exception from it or
    from ``on_broken`` is logged and ends the guard (the group's timeout still
    bounds every collective)."""

    def __init__(
        self,
        world_size: int,
        counts: Callable[[], tuple[int, int]],
        on_broken: Callable[[], None],
        interval: float = INTERVAL,
        name: str = "etcd-rdzv-guard",
    ) -> None:
        self._world_size = world_size
        self._counts = counts
        self._on_broken = on_broken
        self._interval = interval
        self._stop = threading.Event()
        #: Set once the guard saw the round broken (before it cut anything).
        self.fired = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop watching; returns once the thread ended (a cut in progress finishes)."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()

    def _run(self) -> None:
        try:
            while not self._stop.wait(self._interval):
                waiting, live = self._counts()
                if round_broken(self._world_size, waiting, live):
                    self.fired.set()
                    self._on_broken()
                    return
        except Exception:
            log.warning(
                "the round's guard stopped; collectives end at their timeout", exc_info=True
            )
