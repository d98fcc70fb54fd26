"""Admission: which hosts may enter a round.

* :mod:`.hosts`: the exclusion list (``exclude``/``include``), its records;
* :mod:`.health`: the health gate run before each join, failures recorded;
* :mod:`.quarantine`: agents' lives and deaths; a host that keeps dying is excluded.

Called by the rendezvous core (the handler runs the gate and the quarantine, a join
and a round leave excluded hosts out); read by :mod:`etcd_rdzv.runs` for status and by
the CLI for ``exclude``/``include``. Imports nothing of :mod:`etcd_rdzv.rendezvous`.
"""
