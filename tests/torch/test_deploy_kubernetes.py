"""docs/kubernetes.md: its manifests parsed and checked, and its jobs' pods run as torchrun.

No Kubernetes cluster can run here. So the manifests are parsed (PyYAML) and checked
for what the guide relies on, and each job's container is run as two "pods": two
``torchrun`` agents with the container's command and the environment the pod would
get, against a local three-member etcd. For the PyTorchJob that environment includes
what Kubeflow's training operator adds to every Worker pod of an elastic job, computed
here from the manifest as the operator's code does (``kubeflow/training-operator``
release 1.9: ``pkg/controller.v1/pytorch/elastic.go`` and ``envvar.go``, with the
defaults of ``pkg/apis/kubeflow.org/v1/pytorch_defaults.go``). What the test changes:
the etcd endpoints, one worker per pod, at most two pods, the key prefix, and no TLS or
password options (this etcd has neither; the operator guide's test covers them).
"""

from __future__ import annotations

import copy
import json
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import etcd_rdzv
from etcd_rdzv.runs.status import read_run
from etcd_rdzv.testing import EtcdCluster, EtcdServer, TLSFiles
from etcd_rdzv.testing.pytest_plugin import skip_or_fail
from fleet import Fleet, child_env

from ..integration._certs import find_openssl

yaml = pytest.importorskip("yaml")  # PyYAML: in the test extra

HERE = Path(__file__).resolve().parent
GUIDE = HERE.parents[1] / "docs" / "kubernetes.md"
OPERATOR_GUIDE = GUIDE.with_name("operations.md")
AGENT_TIMEOUT = 120.0  # seconds for both agents together; they normally need ~15

_MANIFEST = re.compile(r"^<!-- manifest: ([a-z-]+) -->\n```yaml\n(.*?)^```$", re.M | re.S)
_SECRETS = re.compile(r"^<!-- kubernetes: secrets -->\n```sh\n(.*?)^```$", re.M | re.S)
_CERTS = re.compile(r"^<!-- guide: certs -->\n```sh\n(.*?)^```$", re.M | re.S)
_K8S_VAR = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")
#: The rendezvous options that name a file of the job's Secret, and the others of TLS
#: and auth, which the runs here leave out.
FILE_OPTIONS = ("ca_cert", "ssl_cert", "ssl_cert_key", "password_file")
LEFT_OUT = ("protocol", "username", *FILE_OPTIONS)


# -- the guide ---------------------------------------------------------------------


def manifests() -> dict[str, list[dict[str, Any]]]:
    """Each ``<!-- manifest: NAME -->`` block of the guide, parsed."""
    found = {
        name: list(yaml.safe_load_all(text)) for name, text in _MANIFEST.findall(GUIDE.read_text())
    }
    assert set(found) == {"etcd", "pytorchjob", "indexed-job"}, sorted(found)
    return found


def one(docs: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    matching = [d for d in docs if d["kind"] == kind and name in (None, d["metadata"]["name"])]
    assert len(matching) == 1, f"expected one {kind} {name or ''}: {matching}"
    return matching[0]


def secrets() -> dict[str, set[str]]:
    """The Secrets the guide's ``kubectl create secret`` commands make: name -> keys."""
    (text,) = _SECRETS.findall(GUIDE.read_text())
    made: dict[str, set[str]] = {}
    for command in text.replace("\\\n", " ").splitlines():
        words = shlex.split(command, comments=True)
        if words[:1] != ["kubectl"] or "secret" not in words:
            continue
        name = words[words.index("generic") + 1]
        made[name] = {w.split("=")[1] for w in words if w.startswith("--from-file=")}
    return made


def flags(argv: list[str]) -> dict[str, str]:
    """``--name=value`` arguments (and bare ``--name``, as ``""``)."""
    found = {}
    for arg in argv:
        if arg.startswith("--"):
            name, _, value = arg.partition("=")
            found[name] = value
    return found


def conf(text: str) -> dict[str, str]:
    return dict(item.split("=", 1) for item in text.split(","))


def env_source(container: dict[str, Any], name: str) -> str:
    """Where a container's variable comes from: its value, or the field it refers to."""
    for var in container.get("env", []):
        if var["name"] == name:
            if "value" in var:
                return str(var["value"])
            return str(var["valueFrom"]["fieldRef"]["fieldPath"])
    raise AssertionError(f"no variable {name} in container {container['name']}")


def secret_files(pod: dict[str, Any], container: dict[str, Any]) -> dict[str, tuple[str, str]]:
    """The files the container sees from Secret volumes: path -> (secret, key)."""
    volumes = {v["name"]: v for v in pod.get("volumes", []) if "secret" in v}
    files = {}
    for mount in container.get("volumeMounts", []):
        volume = volumes.get(mount["name"])
        if volume is not None:
            name = volume["secret"]["secretName"]
            for key in secrets()[name]:
                files[f"{mount['mountPath']}/{key}"] = (name, key)
    return files


def members(docs: list[dict[str, Any]]) -> list[str]:
    """The etcd members' client endpoints by their names under the headless Service."""
    sts = one(docs, "StatefulSet")
    return [
        f"{sts['metadata']['name']}-{i}.{sts['spec']['serviceName']}:2379"
        for i in range(sts["spec"]["replicas"])
    ]


# -- Kubeflow's training operator, release 1.9 -----------------------------------------


def kubeflow_env(job: dict[str, Any]) -> dict[str, str]:
    """The variables the operator appends to a Worker container of an elastic job
    without a Master replica, after the container's own."""
    spec, policy = job["spec"], dict(job["spec"]["elasticPolicy"])
    worker = spec["pytorchReplicaSpecs"]["Worker"]
    # pytorch_defaults.go, setElasticPolicy: a missing bound is the other one, or the
    # Worker replicas; setDefaultNprocPerNode: "auto".
    lower, upper = policy.get("minReplicas"), policy.get("maxReplicas")
    if lower is None and upper is None:
        lower = upper = worker.get("replicas", 1)
    lower = upper if lower is None else lower
    upper = lower if upper is None else upper
    nproc = spec.get("nprocPerNode")
    if nproc is None and policy.get("nProcPerNode") is None:
        nproc = "auto"
    env = {"PYTHONUNBUFFERED": "1"}  # envvar.go, setPodEnv
    if nproc is not None:
        env["PET_NPROC_PER_NODE"] = str(nproc)
    # elastic.go, Generate
    host = policy.get("rdzvHost", f"{job['metadata']['name']}-worker-0")
    port = policy.get("rdzvPort")
    if port is None:
        (container,) = [
            c for c in worker["template"]["spec"]["containers"] if c["name"] == "pytorch"
        ]
        ports = {p["name"]: p["containerPort"] for p in container.get("ports", [])}
        port = ports.get("pytorchjob-port", 23456)  # the defaulted port
    env["PET_RDZV_ENDPOINT"] = f"{host}:{port}"
    env["PET_RDZV_BACKEND"] = policy.get("rdzvBackend", "c10d")
    env["PET_NNODES"] = f"{lower}:{upper}"
    if policy.get("maxRestarts") is not None:
        env["PET_MAX_RESTARTS"] = str(policy["maxRestarts"])
    if policy.get("nProcPerNode") is not None:
        env["PET_NPROC_PER_NODE"] = str(policy["nProcPerNode"])
    if policy.get("rdzvId") is not None:
        env["PET_RDZV_ID"] = policy["rdzvId"]
    if policy.get("rdzvConf"):
        env["PET_RDZV_CONF"] = ",".join(f"{c['key']}={c['value']}" for c in policy["rdzvConf"])
    if policy.get("standalone"):
        env["PET_STANDALONE"] = ""
    return env


# -- the manifests, checked --------------------------------------------------------------


def test_etcd_members_services_and_secret_agree() -> None:
    docs = manifests()["etcd"]
    sts = one(docs, "StatefulSet")
    name, service, replicas = (
        sts["metadata"]["name"],
        sts["spec"]["serviceName"],
        sts["spec"]["replicas"],
    )
    assert replicas == 3
    assert sts["spec"]["podManagementPolicy"] == "Parallel"  # members bootstrap together
    labels = sts["spec"]["template"]["metadata"]["labels"]
    assert sts["spec"]["selector"]["matchLabels"] == labels
    headless = one(docs, "Service", service)
    assert headless["spec"]["clusterIP"] == "None"
    assert headless["spec"]["publishNotReadyAddresses"] is True
    client = one(docs, "Service", "etcd-client")
    for svc in (headless, client):
        assert svc["spec"]["selector"] == labels
    assert {p["port"] for p in headless["spec"]["ports"]} == {2379, 2380}
    pdb = one(docs, "PodDisruptionBudget")
    assert pdb["spec"]["minAvailable"] == replicas // 2 + 1  # quorum
    assert pdb["spec"]["selector"]["matchLabels"] == labels

    pod = sts["spec"]["template"]["spec"]
    (anti,) = pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert anti["topologyKey"] == "kubernetes.io/hostname"
    assert anti["labelSelector"]["matchLabels"] == labels
    (container,) = pod["containers"]
    args = flags(container["command"])
    assert container["command"][0] == "etcd"
    assert env_source(container, "POD_NAME") == "metadata.name"
    assert args["--name"] == "$(POD_NAME)"
    assert conf(args["--initial-cluster"]) == {
        f"{name}-{i}": f"https://{name}-{i}.{service}:2380" for i in range(replicas)
    }
    assert args["--initial-advertise-peer-urls"] == f"https://$(POD_NAME).{service}:2380"
    assert args["--advertise-client-urls"] == f"https://$(POD_NAME).{service}:2379"
    assert args["--listen-client-urls"].endswith(":2379")
    assert args["--listen-peer-urls"].endswith(":2380")
    assert "--enable-v2" not in args  # etcd_rdzv's default API is v3
    assert args["--auto-compaction-retention"]
    probe = container["readinessProbe"]["httpGet"]
    assert args["--listen-metrics-urls"] == f"http://0.0.0.0:{probe['port']}"
    assert probe["path"] == "/health"
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    (data,) = sts["spec"]["volumeClaimTemplates"]
    assert args["--data-dir"].startswith(
        next(p for p, n in mounts.items() if n == data["metadata"]["name"]) + "/"
    )
    files = secret_files(pod, container)
    for flag in (
        "--cert-file",
        "--key-file",
        "--trusted-ca-file",
        "--peer-cert-file",
        "--peer-key-file",
        "--peer-trusted-ca-file",
    ):
        assert args[flag] in files, f"{flag}={args[flag]} is no file of a mounted Secret: {files}"
    for flag in ("--client-cert-auth", "--peer-client-cert-auth"):
        assert flag in args
    for var in ("ETCDCTL_CACERT", "ETCDCTL_CERT", "ETCDCTL_KEY"):
        assert env_source(container, var) in files


def _check_pod(pod: dict[str, Any], container: dict[str, Any], rdzv_conf: dict[str, str]) -> None:
    """What both jobs' pods need: the host from the node, the Secret's files where the
    options name them, one pod per node."""
    assert env_source(container, "ETCD_RDZV_HOST_ID") == "spec.nodeName"
    files = secret_files(pod, container)
    for option in FILE_OPTIONS:
        assert rdzv_conf[option] in files, (
            f"{option}={rdzv_conf[option]} is no Secret file: {files}"
        )
    assert {files[rdzv_conf[o]][0] for o in FILE_OPTIONS} == {"etcd-rdzv-job1"}
    assert rdzv_conf["protocol"] == "https"
    assert "password" not in rdzv_conf  # torch logs the rendezvous options
    assert rdzv_conf["key_prefix"].startswith("/etcd_rdzv/")
    (anti,) = pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert anti["topologyKey"] == "kubernetes.io/hostname"


def test_pytorchjob_fields() -> None:
    docs = manifests()
    job = one(docs["pytorchjob"], "PyTorchJob")
    worker = job["spec"]["pytorchReplicaSpecs"]["Worker"]
    assert set(job["spec"]["pytorchReplicaSpecs"]) == {"Worker"}  # elastic: workers only
    env = kubeflow_env(job)
    assert env["PET_RDZV_BACKEND"] == "etcd-rdzv"
    assert env["PET_RDZV_ENDPOINT"].split(",") == members(docs["etcd"])
    assert env["PET_RDZV_ID"] == job["metadata"]["name"]
    assert int(env["PET_MAX_RESTARTS"]) >= 1
    lower, upper = map(int, env["PET_NNODES"].split(":"))
    assert lower < upper == worker["replicas"]
    assert worker["restartPolicy"] == "ExitCode"
    assert job["spec"]["runPolicy"]["backoffLimit"] >= 1
    pod = worker["template"]["spec"]
    (container,) = pod["containers"]
    assert container["name"] == "pytorch"  # the operator's container name
    assert container["command"][0] == "torchrun"
    assert [a for a in container["command"][1:] if a.startswith("-")] == []  # all from PET_*
    assert env_source(container, "PET_LOCAL_ADDR") == "status.podIP"
    _check_pod(pod, container, conf(env["PET_RDZV_CONF"]))
    (anti,) = pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert anti["labelSelector"]["matchLabels"] == {
        "training.kubeflow.org/job-name": job["metadata"]["name"]
    }


def test_indexed_job_fields() -> None:
    docs = manifests()
    job = one(docs["indexed-job"], "Job")
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed"
    assert spec["completions"] == spec["parallelism"]
    assert spec["backoffLimit"] >= 1
    pod = spec["template"]["spec"]
    assert pod["restartPolicy"] == "Never"  # podFailurePolicy requires it
    assert spec["podFailurePolicy"]["rules"][0]["onPodConditions"] == [{"type": "DisruptionTarget"}]
    (container,) = pod["containers"]
    assert container["command"][0] == "torchrun"
    args = flags(container["command"])
    assert args["--rdzv-backend"] == "etcd-rdzv"
    assert args["--rdzv-endpoint"].split(",") == members(docs["etcd"])
    assert args["--rdzv-id"] == job["metadata"]["name"]
    assert int(args["--max-restarts"]) >= 1
    lower, upper = map(int, args["--nnodes"].split(":"))
    assert lower < upper == spec["parallelism"]
    assert args["--local-addr"] == "$(POD_IP)"
    assert env_source(container, "POD_IP") == "status.podIP"
    _check_pod(pod, container, conf(args["--rdzv-conf"]))
    (anti,) = pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert anti["labelSelector"]["matchLabels"] == spec["template"]["metadata"]["labels"]


def test_secrets_block_makes_certificates_that_work(tmp_path: Path) -> None:
    """The guide's certificate and Secret commands, run as written after the operator
    guide's CA block (which defines ``issue``), with a ``kubectl`` that records its
    arguments: the Secrets hold the files the manifests mount, the members'
    certificate names every address the manifests use, and a client with the job's
    files talks TLS to an etcd that serves the members' certificate."""
    if find_openssl() is None:
        skip_or_fail("the guide makes its certificates with the openssl CLI")
    certs, bin_dir = tmp_path / "certs", tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "kubectl-calls"
    kubectl = bin_dir / "kubectl"
    kubectl.write_text(
        f"#!{sys.executable}\nimport json, sys\n"
        f"with open({str(calls)!r}, 'a') as f: f.write(json.dumps(sys.argv[1:]) + '\\n')\n"
    )
    kubectl.chmod(0o755)
    (ca_block,) = _CERTS.findall(OPERATOR_GUIDE.read_text())
    (secrets_block,) = _SECRETS.findall(GUIDE.read_text())
    script = "\n".join(
        [
            "set -euo pipefail",
            f"export CERTS={shlex.quote(str(certs))}",
            "export ETCD1_IP=127.0.0.1 ETCD2_IP=127.0.0.1 ETCD3_IP=127.0.0.1",
            ca_block,
            'echo job1-password > "$CERTS/job1.pw"',  # made by the operator guide's step 3
            secrets_block,
        ]
    )
    env = child_env(PATH=f"{bin_dir}:{child_env()['PATH']}")
    done = subprocess.run(
        ["bash", "-c", script], env=env, capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr

    made: dict[str, dict[str, Path]] = {}
    for line in calls.read_text().splitlines():
        argv = json.loads(line)
        assert argv[:4] == ["-n", "default", "create", "secret"], argv
        files = dict(a.removeprefix("--from-file=").split("=", 1) for a in argv[6:])
        made[argv[5]] = {key: Path(path) for key, path in files.items()}
    assert {name: set(files) for name, files in made.items()} == secrets()
    for files in made.values():
        for path in files.values():
            assert path.stat().st_size > 0, path

    member = made["etcd-member-tls"]
    names = [m.rpartition(":")[0] for m in members(manifests()["etcd"])]
    names += [f"{n}.default.svc" for n in names] + [f"{n}.default.svc.cluster.local" for n in names]
    names += ["etcd-client", "localhost"]
    for name in names:
        checked = subprocess.run(
            ["openssl", "x509", "-noout", "-in", str(member["member.pem"]), "-checkhost", name],
            capture_output=True,
            text=True,
            check=True,
        )
        assert "does match" in checked.stdout, checked.stdout
    client = made["etcd-rdzv-job1"]
    subject = subprocess.run(
        ["openssl", "x509", "-noout", "-subject", "-in", str(client["client.pem"])],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "CN" not in subject, subject  # etcd's gateway refuses a client cert with a CN

    # The job's files, where the PyTorchJob's options name them (the Secret's mount).
    job = one(manifests()["pytorchjob"], "PyTorchJob")
    (container,) = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"]
    mounted = secret_files(
        job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"], container
    )
    options = conf(kubeflow_env(job)["PET_RDZV_CONF"])
    local = {o: str(made[mounted[options[o]][0]][mounted[options[o]][1]]) for o in FILE_OPTIONS}
    tls = TLSFiles(
        cert=str(member["member.pem"]),
        key=str(member["member-key.pem"]),
        ca=str(member["ca.pem"]),
        client_ca=str(member["ca.pem"]),
    )
    with EtcdServer(enable_v2=False, tls=tls) as server:
        params = etcd_rdzv.RendezvousParameters(
            "etcd-rdzv",
            f"localhost:{server.client_port}",
            "train",
            1,
            1,
            protocol=options["protocol"],
            ca_cert=local["ca_cert"],
            ssl_cert=local["ssl_cert"],
            ssl_cert_key=local["ssl_cert_key"],
        )
        etcd_rdzv.create_client(params)  # probes etcd over TLS, with the client certificate
    assert Path(local["password_file"]).read_text() == "job1-password\n"


# -- the pods, run ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def etcd_members() -> Iterator[EtcdCluster]:
    with EtcdCluster(3, enable_v2=False) as cluster:
        yield cluster


def _here(rdzv_conf: dict[str, str], key_prefix: str) -> str:
    """The job's rendezvous options for the local etcd: no TLS or password, the test's
    key prefix."""
    kept = {k: v for k, v in rdzv_conf.items() if k not in LEFT_OUT}
    assert "key_prefix" in kept
    kept["key_prefix"] = key_prefix
    return ",".join(f"{k}={v}" for k, v in kept.items())


def _expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' ``$(VAR)`` expansion in a command (a variable not defined stays)."""
    return _K8S_VAR.sub(lambda m: env.get(m.group(1), m.group(0)), text)


def _container_env(
    container: dict[str, Any], pod_ip: str, node: str, pod_name: str
) -> dict[str, str]:
    fields = {"status.podIP": pod_ip, "spec.nodeName": node, "metadata.name": pod_name}
    env: dict[str, str] = {}
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = _expand(str(var["value"]), env)
        else:
            env[var["name"]] = fields[var["valueFrom"]["fieldRef"]["fieldPath"]]
    return env


def _train(command: list[str], out_dir: Path) -> list[str]:
    """The container's command with torchrun and the script of this machine."""
    assert command[0] == "torchrun" and command[-1] == "/workspace/train.py", command
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        *command[1:-1],
        str(HERE / "_deploy_job.py"),
        str(out_dir),
    ]


def pytorchjob_pods(
    endpoints: list[str], key_prefix: str, out_dir: Path
) -> tuple[dict[str, Any], list[tuple[list[str], dict[str, str]]]]:
    job = copy.deepcopy(one(manifests()["pytorchjob"], "PyTorchJob"))
    policy = job["spec"]["elasticPolicy"]
    # The endpoints as the guide writes them: every member's host:port in rdzvHost but
    # the last one's port, which is rdzvPort.
    host, _, port = ",".join(endpoints).rpartition(":")
    policy.update(rdzvHost=host, rdzvPort=int(port), minReplicas=1, maxReplicas=2)
    policy["rdzvConf"] = [
        {"key": k, "value": v}
        for k, v in conf(
            _here(
                conf(",".join(f"{c['key']}={c['value']}" for c in policy["rdzvConf"])), key_prefix
            )
        ).items()
    ]
    job["spec"]["nprocPerNode"] = "1"
    worker = job["spec"]["pytorchReplicaSpecs"]["Worker"]
    worker["replicas"] = 2
    (container,) = worker["template"]["spec"]["containers"]
    pods = []
    for i in range(2):
        env = {k: v for k, v in child_env().items() if not k.startswith("PET_")}
        env.update(_container_env(container, "127.0.0.1", f"node-{i}", f"train-worker-{i}"))
        env.update(kubeflow_env(job))  # appended after the container's own
        pods.append((_train(container["command"], out_dir), env))
    return job, pods


def indexed_job_pods(
    endpoints: list[str], key_prefix: str, out_dir: Path
) -> tuple[dict[str, Any], list[tuple[list[str], dict[str, str]]]]:
    job = one(manifests()["indexed-job"], "Job")
    (container,) = job["spec"]["template"]["spec"]["containers"]
    pods = []
    for i in range(2):
        env = {k: v for k, v in child_env().items() if not k.startswith("PET_")}
        env.update(_container_env(container, "127.0.0.1", f"node-{i}", f"train-{i}"))
        env["JOB_COMPLETION_INDEX"] = str(i)
        command = []
        for arg in container["command"]:
            name, _, value = arg.partition("=")
            value = {
                "--rdzv-endpoint": ",".join(endpoints),
                "--rdzv-conf": _here(conf(value), key_prefix) if name == "--rdzv-conf" else "",
                "--nproc-per-node": "1",
                "--nnodes": "1:2",
            }.get(name, value)
            command.append(_expand(f"{name}={value}" if value else arg, env))
        pods.append((_train(command, out_dir), env))
    return job, pods


@pytest.mark.torch
@pytest.mark.parametrize("kind", ["pytorchjob", "indexed-job"])
def test_pods_train(
    kind: str,
    torch_required: None,
    etcd_members: EtcdCluster,
    etcd_key_prefix: str,
    job_dir: Path,
    tmp_path: Path,
) -> None:
    endpoints = etcd_members.endpoint.split(",")
    build = pytorchjob_pods if kind == "pytorchjob" else indexed_job_pods
    job, pods = build(endpoints, etcd_key_prefix, job_dir)
    kv = etcd_rdzv.create_client(etcd_members.params(key_prefix=etcd_key_prefix))
    hosts: set[str | None] = set()
    with Fleet(tmp_path) as agents:
        for i, (argv, env) in enumerate(pods):
            agents.run(f"pod{i}", argv, env=env)
        # The members' hosts, while they train: the node names (spec.nodeName).
        deadline = time.monotonic() + AGENT_TIMEOUT
        while any(a.returncode is None for a in agents.processes) and time.monotonic() < deadline:
            run = read_run(kv, etcd_key_prefix, job["metadata"]["name"])
            # (a member that has left shows no host: only the live ones count here)
            hosts.update(m.host for m in run.members if m.host is not None)
            time.sleep(0.2)
        finished = agents.wait_exit(timeout=AGENT_TIMEOUT)
        report = agents.describe()
        assert finished, f"agents still running after {AGENT_TIMEOUT} s\n{report}"
        assert [a.returncode for a in agents.processes] == [0, 0], report

    restarts = "10"  # the guide's maxRestarts / --max-restarts
    written = sorted(p.name for p in job_dir.glob("rank*.json"))
    assert written == ["rank0.json", "rank1.json"], f"{written}\n{report}"
    for rank in (0, 1):
        seen = json.loads((job_dir / f"rank{rank}.json").read_text())
        assert (seen["rank"], seen["world_size"], seen["value"]) == (rank, 2, 3.0), report
        assert seen["TORCHELASTIC_RUN_ID"] == job["metadata"]["name"], f"{seen}\n{report}"
        assert seen["TORCHELASTIC_MAX_RESTARTS"] == restarts, f"{seen}\n{report}"
        assert seen["LOCAL_WORLD_SIZE"] == "1", f"{seen}\n{report}"
        assert seen["MASTER_ADDR"] == "127.0.0.1", f"{seen}\n{report}"  # the pod IP
    assert hosts == {"node-0", "node-1"}, f"{hosts}\n{report}"
