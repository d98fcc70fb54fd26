"""The rendezvous core: the native (and static) handler, one concept per module.

* :mod:`.handler`: the facade torch sees (:class:`EtcdRendezvousHandler`), built from
  settings by ``from_settings``;
* :mod:`.session`: what a node holds (lease, heart, keys, watchers) and its standing
  between joins, behind a closed surface; released by ``shutdown()`` or the
  handler's finalizer;
* :mod:`.join`: one ``next_rendezvous()`` call, from its first key to its round;
* :mod:`.coordinator` and :mod:`.follower`: the two parts a node plays in a round;
* :mod:`.completion`: how a round's result is written and how a node withdraws, in
  one order (v3: a transaction each; v2: a seal);
* :mod:`.decisions`: what to do, and why a join waits, as pure functions of what a
  node sees; :mod:`.waiting` puts the reason in words;
* :mod:`.records` and :mod:`.roster`: the records in etcd, written and parsed in one
  place; a large round's member lists;
* :mod:`.heart`: the liveness owner (heartbeats of a node's keys);
* :mod:`.watch`: the coordinator's view of a round and the members' watcher;
* :mod:`.progress`: what a waiting join reports;
* :mod:`.listener`: the one interface through which others observe a handler;
* :mod:`.incarnation`: a run's life (which job uses the run id, its closing, its
  starting again).

Imports :mod:`etcd_rdzv.admission` (the health gate, exclusions, quarantine), the
client, the store and the KV layer; never :mod:`etcd_rdzv.runs` or the CLI. The
operations on runs (:mod:`etcd_rdzv.runs`) and the CLI read its records.
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
