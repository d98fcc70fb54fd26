"""Store workers run in separate processes by the store tests."""

from __future__ import annotations

import sys
import time

import etcd_rdzv


def _store(endpoint: str, key_prefix: str, run_id: str, api: str) -> etcd_rdzv.EtcdStore:
    params = etcd_rdzv.RendezvousParameters(
        "etcd-rdzv-dynamic", endpoint, run_id, 1, 1, key_prefix=key_prefix, api=api
    )
    # The plain store, as the test's own: create_backend would import torch (seconds
    # per process) when it is installed, and these tests are about the store.
    return etcd_rdzv.EtcdStore(etcd_rdzv.create_client(params), f"{key_prefix}/{run_id}/store")


def adder(
    endpoint: str, key_prefix: str, run_id: str, key: str, times: int, api: str = "v2"
) -> None:
    store = _store(endpoint, key_prefix, run_id, api)
    store.wait(["go"])
    for _ in range(times):
        store.add(key, 1)


def late_setter(
    endpoint: str, key_prefix: str, run_id: str, key: str, delay: float, api: str = "v2"
) -> None:
    store = _store(endpoint, key_prefix, run_id, api)
    store.wait(["go"])
    time.sleep(delay)  # the test checks that the reader waited for this
    store.set(key, f"set-at-{time.monotonic()}")


if __name__ == "__main__":  # pragma: no cover - manual use
    print(sys.argv)
