"""Where ``python3 -m benchmarks.run`` writes its report: docs/benchmarks.md only for a
whole run (or the recovery part alone, which replaces its own section); a partial or
quick run would replace every section of that page with its own few, so it writes into
its work directory unless ``--out`` says where."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import run

DOCS = run.REPO_ROOT / "docs" / "benchmarks.md"
OTHERS = "rendezvous,steady,death,store,imports"


@pytest.fixture(autouse=True)
def _torch(monkeypatch: pytest.MonkeyPatch) -> None:
    # The recovery part's check for torch: these cases are about paths only.
    monkeypatch.setattr(run, "torch_available", lambda: True)


def test_a_whole_run_writes_the_docs_page() -> None:
    args = run.parse_args(["--handlers", "ours"])
    assert (args.out, args.json, args.plot) == (
        DOCS,
        DOCS.with_suffix(".json"),
        DOCS.with_suffix(".png"),
    )


def test_the_recovery_part_alone_writes_its_section_of_the_docs_page() -> None:
    args = run.parse_args(["--skip", f"{OTHERS},large", "--recovery-handlers", "ours"])
    assert args.out == DOCS


@pytest.mark.parametrize(
    "argv",
    [
        # The leader-kill measurement: the large part alone.
        [
            *("--handlers", "ours", "--skip", f"{OTHERS},recovery"),
            *("--large-kill-leader", "--large-cluster", "3"),
        ],
        ["--handlers", "ours", "--skip", "large"],
        ["--quick"],
        ["--quick", "--skip", f"{OTHERS},large"],
    ],
)
def test_a_partial_or_quick_run_leaves_the_docs_page_alone(argv: list[str]) -> None:
    args = run.parse_args(argv)
    # main() puts the report, its JSON and its plot into the run's work directory.
    assert (args.out, args.json, args.plot) == (None, None, None)


def test_a_given_out_is_used_with_its_json_and_plot_beside_it(tmp_path: Path) -> None:
    out = tmp_path / "large.md"
    args = run.parse_args(["--handlers", "ours", "--skip", f"{OTHERS},recovery", "--out", str(out)])
    assert (args.out, args.json, args.plot) == (
        out,
        out.with_suffix(".json"),
        out.with_suffix(".png"),
    )
    given = run.parse_args(["--quick", "--out", str(out), "--json", str(tmp_path / "r.json")])
    assert given.json == tmp_path / "r.json" and given.plot == out.with_suffix(".png")
