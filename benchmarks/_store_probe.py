"""One side of the store latency benchmark (run by :mod:`benchmarks.run`).

``python3 -m benchmarks._store_probe '<json spec>'`` builds a store of ``kind``
(``ours``: :class:`etcd_rdzv.EtcdStore` on the given ``api``; ``torch-etcd``: the
``EtcdStore`` of torch's etcd-v2 rendezvous) and obeys one command per stdin line,
answering one JSON line on stdout each:

* ``get <key>``: answers ``waiting`` just before the blocking ``get`` and ``got``
  (with ``t``, ``time.monotonic()``) once it returned;
* ``set <key>``: answers ``set`` with ``t`` taken just before the write.
"""

from __future__ import annotations

import json
import sys
import time
from datetime import timedelta
from typing import Any


def say(event: str, **fields: Any) -> None:
    sys.stdout.write(json.dumps({"event": event, "t": time.monotonic(), **fields}) + "\n")
    sys.stdout.flush()


def build(spec: dict[str, Any]) -> Any:
    if spec["kind"] == "ours":
        sys.modules["torch"] = None  # type: ignore[assignment]
        import etcd_rdzv

        params = etcd_rdzv.RendezvousParameters(
            "etcd-rdzv", spec["endpoint"], spec["run_id"], 1, 1, api=spec["api"]
        )
        return etcd_rdzv.EtcdStore(
            etcd_rdzv.create_client(params), spec["prefix"], timeout=timedelta(seconds=30)
        )
    import etcd
    from torch.distributed.elastic.rendezvous.etcd_store import EtcdStore

    host, port = spec["endpoint"].rsplit(":", 1)
    store = EtcdStore(etcd.Client(host, int(port)), spec["prefix"])
    store.set_timeout(timedelta(seconds=30))
    return store


def main(argv: list[str]) -> int:
    store = build(json.loads(argv[0]))
    say("ready")
    for line in sys.stdin:
        command, _, key = line.strip().partition(" ")
        if command == "get":
            say("waiting", key=key)
            store.get(key)
            say("got", key=key)
        elif command == "set":
            started = time.monotonic()
            store.set(key, b"x")
            say("set", key=key, t_set=started)
        elif command == "exit":
            break
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
