"""The supported torch releases: declared once and checked against the places that
state them, and one clear sentence on a torch below the range."""

from __future__ import annotations

import configparser
import subprocess
import sys
from pathlib import Path

import pytest

from etcd_rdzv._torch_range import (
    EDGES,
    NEWEST_TESTED,
    OLDEST,
    OLDEST_TESTED,
    check_torch_version,
    release_of,
)

ROOT = Path(__file__).resolve().parents[2]
OLDEST_TEXT = ".".join(map(str, OLDEST))


@pytest.mark.parametrize(
    ("version", "release"),
    [
        ("2.6.0", (2, 6)),
        ("2.13.0+cpu", (2, 13)),
        ("2.16.0a0+git1234", (2, 16)),
        (" 3.0.1 ", (3, 0)),
        ("unknown", None),
        ("2", None),
    ],
)
def test_release_of_reads_torchs_version_strings(
    version: str, release: tuple[int, int] | None
) -> None:
    assert release_of(version) == release


@pytest.mark.parametrize("version", ["2.6.0", "2.13.0+cpu", NEWEST_TESTED, "2.16.0a0+git1"])
def test_supported_releases_pass(version: str) -> None:
    check_torch_version(version)


@pytest.mark.parametrize("version", ["2.5.1", "2.4.1+cu121", "1.13.1", "garbage"])
def test_older_releases_are_one_sentence_naming_both_versions(version: str) -> None:
    with pytest.raises(ImportError) as caught:
        check_torch_version(version)
    message = str(caught.value)
    assert f"torch >= {OLDEST_TEXT}" in message and repr(version) in message, message
    assert NEWEST_TESTED in message


def test_pyproject_extra_readme_and_docs_state_the_same_range() -> None:
    extra = next(
        line
        for line in (ROOT / "pyproject.toml").read_text().splitlines()
        if line.startswith("torch = [")
    )
    assert f'"torch>={OLDEST_TEXT}"' in extra, extra
    readme = (ROOT / "README.md").read_text()
    assert f"torch {OLDEST_TEXT} to {NEWEST_TESTED}" in readme
    testing = (ROOT / "docs" / "testing.md").read_text()
    assert f"torch {OLDEST_TEXT} to {NEWEST_TESTED}" in testing


def test_the_edges_are_the_oldest_supported_and_the_newest_tested_release() -> None:
    assert EDGES == (OLDEST_TESTED, NEWEST_TESTED)
    assert release_of(OLDEST_TESTED) == OLDEST
    newest = release_of(NEWEST_TESTED)
    assert newest is not None and newest > OLDEST
    pinned = (ROOT / "constraints.txt").read_text()
    assert not any(f"torch=={edge}" in pinned for edge in EDGES), "an edge is the pin"


def test_tox_runs_tests_torch_on_each_edge() -> None:
    tox = configparser.ConfigParser(interpolation=None)
    tox.read(ROOT / "tox.ini")
    for env, edge in [("torch-oldest", OLDEST_TESTED), ("torch-newest", NEWEST_TESTED)]:
        section = tox[f"testenv:{env}"]
        assert section["deps"].split() == [f"torch=={edge}"], env
        assert "PIP_CONSTRAINT = /dev/null" in section["setenv"], env
        assert "tests/torch" in section["commands"].split(), env


def test_ci_reads_the_edges_from_the_one_place() -> None:
    edges = (ROOT / ".ci" / "torch-edges").read_text()
    assert "from etcd_rdzv._torch_range import EDGES" in edges
    ci = (ROOT / ".ci" / "run").read_text()
    assert ".ci/torch-edges install" in ci and ".ci/torch-edges test" in ci
    for script in (edges, ci):
        assert "torch==2." not in script, "a torch release written into a CI script"


def test_importing_the_torch_integration_on_an_old_torch_fails_in_one_sentence(
    tmp_path: Path,
) -> None:
    # A torch 2.5.1 stand-in (only its version): the check comes before anything of
    # torch.distributed, so the error is ours, not an AttributeError from inside torch.
    fake = tmp_path / "torch"
    fake.mkdir()
    (fake / "__init__.py").write_text('__version__ = "2.5.1"\n')
    done = subprocess.run(
        [sys.executable, "-c", "import etcd_rdzv.torch"],
        check=False,
        env={"PYTHONPATH": f"{tmp_path}:{ROOT}", "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: etcd_rdzv's torch integration needs torch >= "), last
    assert "'2.5.1'" in last, last
