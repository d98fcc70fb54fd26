"""Shared test set-up: the etcd fixtures from etcd_rdzv.testing, and the torch gate.

Tests that need torch use the ``torch_required`` fixture (or ``needs_torch()``). Where
CI is meant to run them it sets ``ETCD_RDZV_REQUIRE_TORCH=1``, and a missing torch
is then a failure, not a skip.
"""

from __future__ import annotations

import importlib.util
import os

import pytest

pytest_plugins = ["etcd_rdzv.testing.pytest_plugin"]


def needs_torch() -> None:
    """Skip (locally) or fail (when ETCD_RDZV_REQUIRE_TORCH=1) if torch is missing."""
    if importlib.util.find_spec("torch") is not None:
        return
    if os.environ.get("ETCD_RDZV_REQUIRE_TORCH") == "1":
        pytest.fail("torch is not installed but ETCD_RDZV_REQUIRE_TORCH=1 (CI must run these)")
    pytest.skip("torch is not installed: pip install -c constraints.txt -e '.[torch]'")


@pytest.fixture
def torch_required() -> None:
    needs_torch()
