"""What every part of the report reads: the series' labels, the rendezvous table (one
cell per series and N), the markdown cells, and the plot of time to rendezvous.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

LABELS = {
    "ours/v2": "etcd_rdzv, v2 API",
    "ours/v3": "etcd_rdzv, v3 API",
    "ours-fast/v3": "etcd_rdzv, v3 API, faster detection (TTL 2 s)",
    "ours-fast/v2": "etcd_rdzv, v2 API, faster detection (TTL 2 s)",
    "ours-dynamic/v2": "torch dynamic over etcd_rdzv backend, v2",
    "ours-dynamic/v3": "torch dynamic over etcd_rdzv backend, v3",
    "etcd-v2/v2": "torch etcd-v2",
    "etcd/v2": "torch etcd (legacy)",
    "c10d": "torch c10d",
    "inprocess/v3": "etcd_rdzv in-process (no torchrun), v3 API",
    "inprocess/v2": "etcd_rdzv in-process (no torchrun), v2 API",
    "nvrx-tcpstore": "NVRx Wrapper, its TCPStores (on rank 0)",
    "nvrx-etcd/v3": "NVRx Wrapper, etcd_rdzv's stores, v3 API",
}


def label(key: str) -> str:
    return LABELS.get(key, key)


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def rendezvous_table(results: dict[str, Any]) -> dict[tuple[str, int], dict[str, Any]]:
    """``(series, n)`` -> median, min, max seconds, request and write medians, errors."""
    cells: dict[tuple[str, int], dict[str, Any]] = defaultdict(
        lambda: {"seconds": [], "requests": [], "writes": [], "errors": [], "layout": ""}
    )
    for row in results["rendezvous"]:
        cell = cells[(row["series"], row["n"])]
        cell["layout"] = row.get("layout", "")
        if row.get("error"):
            cell["errors"].append(row["error"])
        if row.get("seconds") is not None and not row.get("error"):
            cell["seconds"].append(row["seconds"])
        for name in ("requests", "writes"):
            if row.get(name) is not None:
                cell[name].append(row[name])
    out = {}
    for key, cell in cells.items():
        secs = cell["seconds"]
        out[key] = {
            "median": _median(secs),
            "min": min(secs) if secs else None,
            "max": max(secs) if secs else None,
            "reps": len(secs),
            "requests": _median(cell["requests"]),
            "writes": _median(cell["writes"]),
            "errors": cell["errors"],
            "layout": cell["layout"],
        }
    return out


def fmt(value: float | None, digits: int = 2, unit: str = "") -> str:
    return "-" if value is None else f"{value:.{digits}f}{unit}"


def md_row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def plot(results: dict[str, Any], path: Path) -> bool:
    """Time to rendezvous against N, one line per handler. False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install -e '.[bench]'): no plot")
        return False
    table = rendezvous_table(results)
    series = sorted(
        {key for key, _ in table}, key=lambda k: list(LABELS).index(k) if k in LABELS else 99
    )
    fig, ax = plt.subplots(figsize=(8, 5), dpi=110)
    for key in series:
        points = sorted(
            (n, c) for (s, n), c in table.items() if s == key and c["median"] is not None
        )
        if not points:
            continue
        xs = [n for n, _ in points]
        ys = [c["median"] for _, c in points]
        low = [c["median"] - c["min"] for _, c in points]
        high = [c["max"] - c["median"] for _, c in points]
        style = "-" if key.startswith("ours/") else "--"
        ax.errorbar(xs, ys, yerr=[low, high], fmt=style + "o", capsize=3, label=label(key))
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("nodes N (min_nodes = max_nodes = N)")
    ax.set_ylabel("seconds from go to the last node's rank (median, min-max)")
    ax.set_title("Time to rendezvous")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return True
