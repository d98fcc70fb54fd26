"""Shared test set-up: the etcd fixtures from etcd_rdzv.testing, and the torch gate.

Tests that need torch use the ``torch_required`` fixture (or ``needs_torch()``). Where
CI is meant to run them it sets ``ETCD_RDZV_REQUIRE_TORCH=1``, and a missing torch
is then a failure, not a skip. CI also sets ``ETCD_RDZV_NO_SKIP=1``, which makes any
skip at all a failure (see the plugin's ``skip_or_fail``).
"""

from __future__ import annotations

import importlib.util

import pytest

pytest_plugins = ["etcd_rdzv.testing.pytest_plugin"]


def needs_torch() -> None:
    """Skip (locally) or fail (when ETCD_RDZV_REQUIRE_TORCH=1 or ETCD_RDZV_NO_SKIP=1)
    if torch is missing."""
    if importlib.util.find_spec("torch") is not None:
        return
    # Imported here, not at the top: pytest must be the first to import the plugin
    # (pytest_plugins above), or it cannot rewrite the plugin's asserts.
    from etcd_rdzv.testing.pytest_plugin import skip_or_fail

    skip_or_fail(
        "torch is not installed: pip install -c constraints.txt -e '.[torch]'",
        require="ETCD_RDZV_REQUIRE_TORCH",
    )


@pytest.fixture
def torch_required() -> None:
    needs_torch()
