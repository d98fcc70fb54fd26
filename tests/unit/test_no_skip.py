"""``ETCD_RDZV_NO_SKIP=1`` (set by CI) turns every kind of skip into a failure that
names the skip's reason, and every expected failure (xfail) that is not a declared known
difference, or that passed, too; without it a skip stays a skip. A pytest run of its
own, in a subprocess, on test files that skip (or expect to fail) in each way pytest
offers."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import etcd_rdzv
from etcd_rdzv.testing.pytest_plugin import NO_SKIP_ENV, known_difference

_SKIPPING = textwrap.dedent(
    """
    import pytest

    from etcd_rdzv.testing.pytest_plugin import known_difference, skip_or_fail


    def test_calls_skip():
        pytest.skip("reason-one")


    @pytest.mark.skip(reason="reason-two")
    def test_marked_skip():
        pass


    @pytest.mark.skipif(True, reason="reason-three")
    def test_marked_skipif():
        pass


    @pytest.fixture
    def missing():
        skip_or_fail("reason-four")


    def test_fixture_skips(missing):
        pass


    @known_difference("not a skip")
    def test_expected_failure():
        raise AssertionError


    def test_passes():
        pass
    """
)

_SKIPPED_AT_COLLECTION = textwrap.dedent(
    """
    import pytest

    pytest.importorskip("no_such_module_anywhere_etcd_rdzv")


    def test_never_collected():
        pass
    """
)


def _run(
    tmp_path: Path, no_skip: str | None, text: str = _SKIPPING, *options: str
) -> tuple[int, str]:
    (tmp_path / "test_it.py").write_text(text)
    env = dict(os.environ)
    env.pop(NO_SKIP_ENV, None)
    if no_skip is not None:
        env[NO_SKIP_ENV] = no_skip
    repo = str(Path(etcd_rdzv.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [repo, env.get("PYTHONPATH")]))
    done = subprocess.run(
        [
            *(sys.executable, "-m", "pytest", "-p", "etcd_rdzv.testing.pytest_plugin"),
            *("-p", "no:cacheprovider", "-q", "-rA", *options),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    # stderr first: the summary is the last line of stdout (a plugin may warn on stderr).
    return done.returncode, done.stderr + done.stdout


@pytest.mark.parametrize("options", [(), ("-n", "2")], ids=["serial", "xdist"])
def test_every_skip_is_a_failure_naming_its_reason(
    tmp_path: Path, options: tuple[str, ...]
) -> None:
    """Also in pytest-xdist's workers, as CI runs the suite."""
    code, out = _run(tmp_path, "1", _SKIPPING, *options)
    assert code == 1, out
    # A skip in the test is a failure, one in its set-up (markers, fixtures) an error.
    assert "1 failed, 1 passed, 1 xfailed, 3 errors" in out, out
    for reason in ("reason-one", "reason-two", "reason-three"):
        assert f"every skip a failure; this one skipped: Skipped: {reason}" in out, out
    assert f"{NO_SKIP_ENV}=1 but reason-four" in out, out  # skip_or_fail fails at once
    assert "skipped" not in out.splitlines()[-1], out


def test_a_skip_at_collection_is_a_collection_error(tmp_path: Path) -> None:
    code, out = _run(tmp_path, "1", _SKIPPED_AT_COLLECTION)
    assert code == 2, out  # interrupted: an error during collection
    assert "1 error" in out, out
    assert f"{NO_SKIP_ENV}=1 makes every skip a failure; this one skipped: " in out, out
    assert "no_such_module_anywhere_etcd_rdzv" in out, out


@pytest.mark.parametrize("no_skip", [None, "0"])
def test_without_it_skips_stay_skips(tmp_path: Path, no_skip: str | None) -> None:
    code, out = _run(tmp_path, no_skip)
    assert code == 0, out
    assert "1 passed, 4 skipped, 1 xfailed" in out, out
    assert "makes every skip a failure" not in out, out
    code, out = _run(tmp_path, no_skip, _SKIPPED_AT_COLLECTION)
    assert code == 5, out  # nothing collected: the module skipped
    assert "1 skipped" in out, out


_PROBES = {
    "declared-xfail": (
        """
        from etcd_rdzv.testing.pytest_plugin import known_difference

        @known_difference("ours differs", raises=ValueError)
        def test_it():
            raise ValueError("as declared")
        """,
        0,
        "1 xfailed",
    ),
    "undeclared-xfail": (
        """
        import pytest

        @pytest.mark.xfail(reason="hand-written", strict=True)
        def test_it():
            raise ValueError
        """,
        1,
        "is not a known difference (hand-written)",
    ),
    "xfail-called": (
        """
        import pytest

        def test_it():
            pytest.xfail("called in the test")
        """,
        1,
        "is not a known difference (called in the test)",
    ),
    "non-strict-xpass": (
        """
        import pytest

        @pytest.mark.xfail(reason="went away", strict=False)
        def test_it():
            pass
        """,
        1,
        "this expected failure passed (XPASS: went away)",
    ),
    "declared-reason-non-strict-xpass": (
        """
        import pytest

        from etcd_rdzv.testing.pytest_plugin import known_difference

        known_difference("declared")

        @pytest.mark.xfail(reason="declared", strict=False)
        def test_it():
            pass
        """,
        1,
        "this expected failure passed (XPASS: declared)",
    ),
    "declared-xpass": (
        """
        from etcd_rdzv.testing.pytest_plugin import known_difference

        @known_difference("went away")
        def test_it():
            pass
        """,
        1,
        "[XPASS(strict)] went away",
    ),
    "skip": (
        """
        import pytest

        def test_it():
            pytest.skip("not here")
        """,
        1,
        "this one skipped: Skipped: not here",
    ),
}


@pytest.mark.parametrize("probe", list(_PROBES))
def test_only_a_declared_failing_known_difference_passes(tmp_path: Path, probe: str) -> None:
    """Under ``ETCD_RDZV_NO_SKIP=1`` a probe file exits 0 only for an expected failure
    declared with ``known_difference()`` that fails as declared."""
    text, expected, message = _PROBES[probe]
    code, out = _run(tmp_path, "1", textwrap.dedent(text))
    assert code == expected, out
    assert message in out, out
    if expected:
        assert "1 failed" in out.splitlines()[-1], out


def test_known_difference_needs_a_reason() -> None:
    with pytest.raises(ValueError, match="needs a reason"):
        known_difference("  ")
