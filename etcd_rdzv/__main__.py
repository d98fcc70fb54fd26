"""``python -m etcd_rdzv``: the ``etcd-rdzv`` command line (see :mod:`etcd_rdzv.cli`)."""

from __future__ import annotations

from .cli import main

if __name__ == "__main__":
    raise SystemExit(main())
