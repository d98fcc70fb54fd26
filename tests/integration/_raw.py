"""Raw reads of etcd's v2 API, to check what the package wrote without going through it."""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
from typing import Any


def v2_node(client_url: str, key: str) -> dict[str, Any] | None:
    """The v2 node at ``key`` (``None`` if absent)."""
    try:
        with urllib.request.urlopen(f"{client_url}/v2/keys{key}", timeout=5) as resp:
            node: dict[str, Any] = json.loads(resp.read())["node"]
            return node
    except urllib.error.HTTPError as exc:
        if exc.code == 404:
            return None
        raise


def v2_put(client_url: str, key: str, value: str) -> None:
    """Write ``value`` at ``key`` directly."""
    data = f"value={urllib.parse.quote(value)}".encode()
    req = urllib.request.Request(f"{client_url}/v2/keys{key}", data=data, method="PUT")
    req.add_header("Content-Type", "application/x-www-form-urlencoded")
    with urllib.request.urlopen(req, timeout=5):
        pass
