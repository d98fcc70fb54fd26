"""The floor of a rendezvous of N node *processes* on this machine, without any library.

``python3 -m benchmarks.floor --nodes 1024 --size 26000`` starts one etcd member (v3)
and N Python processes. Each opens two connections to etcd's v3 gateway before the
clock; on the go signal it opens a watch of one key, puts a key of its own, waits for
the announcement (a value of ``--size`` bytes listing every node) and finds its rank
in it: the least a node of any rendezvous over this gateway must do, in plain sockets
and ``json``. This process plays the coordinator: it counts the puts over one prefix
watch, then writes the announcement. It prints when all had joined and when the last
node had its rank, the median CPU of a node process, and etcd's CPU.

What our handler adds on top of this (threads, failover, strict parsing, heartbeats,
member watchers) is the difference to its Large N rows; see NOTES.md.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import IO, Any

from etcd_rdzv.testing import EtcdServer

from ._etcd import cpu_seconds, scrape

#: One node: everything before the byte on the go pipe is before the clock.
NODE = r"""
import base64, json, os, socket, sys, time
host, port, me, go = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
def connect():
    s = socket.create_connection((host, port))
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s, s.makefile("rb")
def post(s, path, body):
    data = json.dumps(body).encode()
    s.sendall(b"POST %s HTTP/1.1\r\nHost: etcd\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n%s" % (path.encode(), len(data), data))
def headers(f):
    found = {}
    f.readline()
    while (line := f.readline()) not in (b"\r\n", b""):
        name, _, value = line.partition(b":")
        found[name.strip().lower()] = value.strip()
    return found
def messages(f):
    buf = b""
    while size := int(f.readline().split(b";")[0], 16):
        buf += f.read(size)
        f.readline()
        *lines, buf = buf.split(b"\n")
        yield from (json.loads(line) for line in lines if line.strip())
(w, wf), (u, uf) = connect(), connect()
print("ready", flush=True)
os.read(go, 1)
cpu = time.process_time()
post(w, "/v3/watch", {"create_request": {"key": base64.b64encode(b"/floor/ann").decode()}})
headers(wf)
stream = messages(wf)
next(stream)
key = base64.b64encode(b"/floor/nodes/" + me.encode()).decode()
post(u, "/v3/kv/put", {"key": key, "value": base64.b64encode(b"x" * 40).decode()})
json.loads(uf.read(int(headers(uf)[b"content-length"])))
for message in stream:
    events = message.get("result", {}).get("events")
    if events:
        value = json.loads(base64.b64decode(events[0]["kv"]["value"]))
        rank = value["members"].index(me)
        break
print(time.monotonic(), time.process_time() - cpu, rank, flush=True)
sys.stdin.read()
"""


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def _post(sock: socket.socket, path: str, body: object) -> None:
    data = json.dumps(body).encode()
    head = f"POST {path} HTTP/1.1\r\nHost: etcd\r\nContent-Length: {len(data)}\r\n\r\n"
    sock.sendall(head.encode() + data)


def _messages(f: IO[bytes]) -> Iterator[dict[str, Any]]:
    while f.readline() not in (b"\r\n", b""):  # the headers
        pass
    buf = b""
    while size := int(f.readline().split(b";")[0], 16):
        buf += f.read(size)
        f.readline()
        *lines, buf = buf.split(b"\n")
        yield from (json.loads(line) for line in lines if line.strip())


def _etcd_cpu(url: str) -> float:
    found = cpu_seconds(scrape(url))
    assert found is not None, "etcd reports no process_cpu_seconds_total"
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m benchmarks.floor", description=__doc__)
    parser.add_argument("--nodes", type=int, default=1024, help="node processes (1024)")
    parser.add_argument("--size", type=int, default=26000, help="announcement bytes (26000)")
    args = parser.parse_args(argv)
    if args.nodes < 1 or args.size < 1:
        parser.error(f"--nodes and --size must be positive: {args.nodes}, {args.size}")
    with EtcdServer("floor") as server:
        host, port = server.endpoint.rsplit(":", 1)
        host = host.split("//")[-1]
        read, write = os.pipe()
        nodes = [
            subprocess.Popen(
                [sys.executable, "-c", NODE, host, port, str(i), str(read)],
                pass_fds=(read,),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
            )
            for i in range(args.nodes)
        ]
        try:
            for node in nodes:
                assert node.stdout is not None and node.stdout.readline() == b"ready\n"
            time.sleep(3.0)  # the last ones' start-up is over
            coord = socket.create_connection((host, int(port)))
            watch = {"key": _b64("/floor/nodes/"), "range_end": _b64("/floor/nodes0")}
            _post(coord, "/v3/watch", {"create_request": watch})
            stream = _messages(coord.makefile("rb"))
            next(stream)
            etcd_cpu = _etcd_cpu(server.client_url)
            go = time.monotonic()
            os.write(write, b"g" * args.nodes)
            joined: set[str] = set()
            for message in stream:
                for event in (message.get("result") or {}).get("events") or []:
                    joined.add(event["kv"]["key"])
                if len(joined) >= args.nodes:
                    break
            all_joined = time.monotonic() - go
            members = [str(i) for i in range(args.nodes)]
            bare = len(json.dumps({"members": members, "pad": ""}))
            pad = "p" * max(0, args.size - bare)
            value = json.dumps({"members": members, "pad": pad})
            put = socket.create_connection((host, int(port)))
            _post(put, "/v3/kv/put", {"key": _b64("/floor/ann"), "value": _b64(value)})
            ranked, cpus = [], []
            for node in nodes:
                assert node.stdout is not None
                at, cpu, _ = node.stdout.readline().split()
                ranked.append(float(at) - go)
                cpus.append(float(cpu))
            etcd_cpu = _etcd_cpu(server.client_url) - etcd_cpu
        finally:
            for node in nodes:
                node.kill()
                node.wait()
    print(
        f"floor, {args.nodes} processes, announcement {len(value)} B: all joined "
        f"{all_joined:.2f}s, last rank {max(ranked):.2f}s "
        f"(median {statistics.median(ranked):.2f}s); "
        f"node process CPU median {1e3 * statistics.median(cpus):.2f} ms; etcd CPU {etcd_cpu:.2f}s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
