"""Operations on runs, as operators see them: shared by the CLI and other tools.

* :mod:`.status`: a run's members, waiting nodes, excluded hosts and problems, one
  JSON schema; its watch; the runs under a prefix;
* :mod:`.delete`: every key of a run removed, after checking for live nodes;
* :mod:`.torch_state` (with :mod:`._pickle_scan`): torch's dynamic-rendezvous state,
  read without running it.

Reads the records of :mod:`etcd_rdzv.rendezvous` and :mod:`etcd_rdzv.admission`; the
rendezvous core never imports it (closing a run is the core's: ``close_run``).
"""
