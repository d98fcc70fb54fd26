"""The native (and static) rendezvous handler, one job per module.

* :mod:`.decisions`: what to do, as pure functions of what a node sees;
* :mod:`.records`: the records in etcd, written and parsed in one place;
* :mod:`.heart`: the liveness owner (heartbeats of a node's keys);
* :mod:`.watch`: the coordinator's view of a round and the members' watcher;
* :mod:`.handler`: the executor (the only module that drives a join);
* :mod:`.status`: a run as operators see it (status, watch, close, delete), shared
  with the CLI;
* :mod:`.torch_state`: torch's dynamic-rendezvous state, read without running it.
"""

from .handler import HANDLER_NAME, EtcdRendezvousHandler, RendezvousResult

__all__ = ["HANDLER_NAME", "EtcdRendezvousHandler", "RendezvousResult"]
