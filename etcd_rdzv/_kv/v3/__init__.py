"""The KV layer on etcd's v3 API, through its JSON gateway (``/v3/...``) over urllib3.

No client library: each primitive is one or two POSTs to the gateway that etcd 3.4
and newer serve on their client port (see ``docs/api.md`` for why not etcd3gw).
Failover is :mod:`.._failover`'s, as for v2: one request goes to one endpoint at a
time; a request that provably never left (refused, connect timeout, TLS) moves to the
next; a create or compare-and-set whose response was lost is resolved by reading the
key back; leader elections are waited out until ``read_timeout``.

Modules, each importing only those above it:

* :mod:`._wire`: codecs, one request and its answer, auth tokens, how failures are
  judged (:class:`~._wire.GatewayKV`);
* :mod:`._lease`: TTLs as leases, clean-up and owned;
* :mod:`._watch`: watch requests and streams kept open;
* :mod:`.kv`: the key operations (:class:`~.kv.V3KV`).
"""

from .kv import V3KV

__all__ = ["V3KV"]
