"""What the round's announcement costs as N grows: its bytes and each follower's CPU.

``python3 -m benchmarks.announce [--nodes 256,1024,4096,10000]`` builds, for each N, the
result a coordinator writes (N node ids of the handler's default form, ``<host>_<12
hex>``, and N addresses) and the announcement made of it (compressed, in base64), as
:mod:`etcd_rdzv.rendezvous.records` writes them, then times with
``time.process_time`` what every follower does with it: decode the v3 gateway's JSON
watch event (the value in base64 once more) and parse the announcement. No etcd: this
is the part of a round that grows with N at every node. It prints per N: the sizes,
the CPU per follower and both summed over N followers (the bytes etcd sends to the
watchers of the coordinator key, the CPU the nodes spend in all).
"""

from __future__ import annotations

import argparse
import base64
import json
import time
import uuid

from etcd_rdzv._kv import Record
from etcd_rdzv.rendezvous import records

AS_OF = 1000  # the decision's revision; the announcement is written after it


def _timed(fn: object, reps: int) -> float:
    """Seconds of CPU one call of ``fn`` takes (the mean of ``reps``)."""
    assert callable(fn)
    began = time.process_time()
    for _ in range(reps):
        fn()
    return (time.process_time() - began) / reps


def measure(n: int, reps: int) -> dict[str, float]:
    """Sizes and per-follower CPU of the announcement of an ``n``-member round."""
    members = tuple(f"host{i:05d}_{uuid.uuid4().hex[:12]}" for i in range(n))
    addrs = tuple(f"host{i:05d}.cluster.example" for i in range(n))
    result = records.result_record(members, addrs, AS_OF, n)
    message = records.announcement(members[0], result=result)
    value = base64.b64encode(message.encode()).decode()
    event = json.dumps({"result": {"events": [{"kv": {"key": "a2V5", "value": value}}]}})
    record = Record("/run/rdzv/r1/coord", message, AS_OF + 1, AS_OF + 1)

    def follower() -> None:
        data = json.loads(event)
        base64.b64decode(data["result"]["events"][0]["kv"]["value"])
        records.parse_announcement(record)

    cpu = _timed(follower, reps)
    return {
        "n": n,
        "result": len(result),
        "announcement": len(message),
        "event": len(event),
        "cpu": cpu,
        "bytes_all": len(event) * n,
        "cpu_all": cpu * n,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", default="256,1024,4096,10000", help="the Ns, comma-separated")
    parser.add_argument("--reps", type=int, default=20, help="parses timed per N (default 20)")
    args = parser.parse_args(argv)
    print(
        f"{'N':>6} {'result B':>10} {'announce B':>10} {'event B':>9} "
        f"{'CPU/node ms':>11} {'sent in all MB':>14} {'CPU in all s':>12}"
    )
    for n in (int(x) for x in args.nodes.split(",")):
        m = measure(n, args.reps)
        print(
            f"{n:>6} {m['result']:>10} {m['announcement']:>10} {m['event']:>9} "
            f"{m['cpu'] * 1000:>11.2f} {m['bytes_all'] / 1e6:>14.1f} {m['cpu_all']:>12.2f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
