"""The native (and static) rendezvous handler, one job per module.

* :mod:`.handler`: the facade torch sees (:class:`EtcdRendezvousHandler`);
* :mod:`.session`: what a node holds (lease, heart, keys, watchers) and its standing
  between joins; released by ``shutdown()`` or the handler's finalizer;
* :mod:`.join`: one ``next_rendezvous()`` call, from its first key to its round;
* :mod:`.coordinator` and :mod:`.follower`: the two parts a node plays in a round;
* :mod:`.completion`: how a round's result is written and how a node withdraws, in
  one order (v3: a transaction each; v2: a seal);
* :mod:`.decisions`: what to do, as pure functions of what a node sees;
* :mod:`.records`: the records in etcd, written and parsed in one place;
* :mod:`.heart`: the liveness owner (heartbeats of a node's keys);
* :mod:`.watch`: the coordinator's view of a round and the members' watcher;
* :mod:`.progress`: what a waiting join reports;
* :mod:`.listener`: the one interface through which others observe a handler;
* :mod:`.status`: a run as operators see it (status, watch, close, delete), shared
  with the CLI;
* :mod:`.torch_state` (with :mod:`._pickle_scan`): torch's dynamic-rendezvous state,
  read without running it.
"""

from .handler import HANDLER_NAME, EtcdRendezvousHandler, RendezvousResult
from .listener import HandlerEvent, Listener, RoundDone

__all__ = [
    "HANDLER_NAME",
    "EtcdRendezvousHandler",
    "HandlerEvent",
    "Listener",
    "RendezvousResult",
    "RoundDone",
]
