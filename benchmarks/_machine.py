"""The machine a benchmark ran on and the versions it ran, for the report."""

from __future__ import annotations

import contextlib
import os
import platform
from pathlib import Path
from typing import Any

from ._etcd import etcd_version


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
    }
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                info["memory_gib"] = round(int(line.split()[1]) / 1024 / 1024, 1)
    return info


def versions() -> dict[str, str]:
    from importlib import metadata

    out = {"etcd": etcd_version()}
    for dist in ("etcd_rdzv", "torch", "python-etcd", "urllib3", "matplotlib"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = "not installed"
    return out
