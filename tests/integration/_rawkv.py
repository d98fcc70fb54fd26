"""Raw reads and writes of either etcd API, to check what the package wrote without
going through it (stdlib only: nothing here shares code with etcd_rdzv)."""

from __future__ import annotations

import base64
import json
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class RawKey:
    """A key as etcd holds it. ``ttl``: seconds left (v2 key TTL, v3 lease TTL), or
    ``None`` when it does not expire. ``lease``/``granted``: the v3 lease and its TTL."""

    value: str
    revision: int
    ttl: int | None
    lease: int = 0
    granted: int | None = None


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def _end(prefix: str) -> str:
    raw = bytearray(prefix.encode())
    raw[-1] += 1
    return base64.b64encode(bytes(raw)).decode()


def v3_post(client_url: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """POST to the v3 JSON gateway; the decoded answer (first line of a stream)."""
    request = urllib.request.Request(
        f"{client_url}{path}",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=5) as resp:
        first = resp.read().decode().strip().splitlines()[0]
    data: dict[str, Any] = json.loads(first)
    return data.get("result", data)


def lease_ttl(client_url: str, lease: int) -> tuple[int, int]:
    """``(seconds left, granted TTL)`` of a v3 lease; ``(-1, 0)`` when it is gone."""
    data = v3_post(client_url, "/v3/lease/timetolive", {"ID": str(lease)})
    return int(data.get("TTL") or 0), int(data.get("grantedTTL") or 0)


def revoke(client_url: str, lease: int) -> None:
    v3_post(client_url, "/v3/lease/revoke", {"ID": str(lease)})


def compact(client_url: str, revision: int) -> None:
    v3_post(client_url, "/v3/kv/compaction", {"revision": str(revision), "physical": True})


def raw_get(client_url: str, api: str, key: str) -> RawKey | None:
    """The key as etcd's ``api`` keyspace holds it, or ``None``."""
    if api == "v2":
        try:
            with urllib.request.urlopen(f"{client_url}/v2/keys{key}", timeout=5) as resp:
                node = json.loads(resp.read())["node"]
        except urllib.error.HTTPError as exc:
            if exc.code == 404:
                return None
            raise
        return RawKey(node.get("value", ""), int(node["modifiedIndex"]), node.get("ttl"))
    kvs = v3_post(client_url, "/v3/kv/range", {"key": _b64(key)}).get("kvs") or []
    if not kvs:
        return None
    kv = kvs[0]
    value = base64.b64decode(kv.get("value", "")).decode()
    lease = int(kv.get("lease") or 0)
    if not lease:
        return RawKey(value, int(kv["mod_revision"]), None)
    ttl, granted = lease_ttl(client_url, lease)
    return RawKey(value, int(kv["mod_revision"]), ttl, lease, granted)


def raw_put(client_url: str, api: str, key: str, value: str) -> None:
    """Write ``value`` at ``key`` directly, in the ``api`` keyspace."""
    if api == "v2":
        data = f"value={urllib.parse.quote(value)}".encode()
        request = urllib.request.Request(f"{client_url}/v2/keys{key}", data=data, method="PUT")
        request.add_header("Content-Type", "application/x-www-form-urlencoded")
        with urllib.request.urlopen(request, timeout=5):
            return
    v3_post(client_url, "/v3/kv/put", {"key": _b64(key), "value": _b64(value)})


def raw_exists_under(client_url: str, api: str, directory: str) -> bool:
    """Whether the directory ``directory`` (v2) or any key below it (v3) exists."""
    if api == "v2":
        return raw_get(client_url, "v2", directory) is not None
    body = {"key": _b64(directory + "/"), "range_end": _end(directory + "/"), "count_only": True}
    return int(v3_post(client_url, "/v3/kv/range", body).get("count") or 0) > 0


def watch_streams_started(client_url: str) -> int:
    """How many v3 watch streams etcd has opened since it started (its metrics)."""
    with urllib.request.urlopen(f"{client_url}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    for line in text.splitlines():
        if line.startswith("grpc_server_started_total{") and (
            'grpc_method="Watch"' in line and 'grpc_service="etcdserverpb.Watch"' in line
        ):
            return int(float(line.rsplit(" ", 1)[1]))
    raise AssertionError("etcd's metrics count no watch streams")


def raw_listing(client_url: str, api: str, directory: str) -> dict[str, str]:
    """Everything etcd's ``api`` keyspace holds below ``directory``: each key and its
    value, and (v2) each directory, as ``"<dir>/"`` with an empty value."""
    if api == "v3":
        body = {"key": _b64(directory + "/"), "range_end": _end(directory + "/")}
        kvs = v3_post(client_url, "/v3/kv/range", body).get("kvs") or []
        return {
            base64.b64decode(kv["key"]).decode(): base64.b64decode(kv.get("value", "")).decode()
            for kv in kvs
        }
    url = f"{client_url}/v2/keys{urllib.parse.quote(directory)}?recursive=true"
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            root = json.loads(resp.read())["node"]
    except urllib.error.HTTPError as exc:
        if exc.code == 404:
            return {}
        raise
    found: dict[str, str] = {}

    def walk(node: dict[str, Any]) -> None:
        for child in node.get("nodes") or []:
            if child.get("dir"):
                found[child["key"] + "/"] = ""
                walk(child)
            else:
                found[child["key"]] = child.get("value", "")

    walk(root)
    return found
