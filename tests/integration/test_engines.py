"""The engines people already run: Kubernetes (manifests, and the environment their pods get,
on the emulated cluster), Ray Train and Spark's TorchDistributor (local instances here)."""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import pytest
import yaml

from gradmesh.errors import GradmeshError
from gradmesh.launch import emulate, namespaces
from gradmesh.launch.emulate import EmulatedCluster
from gradmesh.launch.run import cluster_defaults
from gradmesh.train.config import TrainConfig
from tests.conftest import TAG
from tests.harness import kept_environment
from tests.integration.test_cli import ROOT, gradmesh

MANIFESTS = ROOT / "deploy" / "kubernetes"
OPERATOR_PORT = 23456  # Kubeflow's PET_MASTER_PORT when the Master declares pytorchjob-port


def manifest(name: str) -> dict[str, Any]:
    """The manifest's documents by kind."""
    docs = list(yaml.safe_load_all((MANIFESTS / name).read_text()))
    return {doc["kind"]: doc for doc in docs}


def container_env(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: str(e["value"]) for e in container.get("env", [])}


def pytorchjob_env(job: dict[str, Any], master: str) -> list[dict[str, str]]:
    """What Kubeflow's training operator (v1, torchrun mode) puts in each pod's environment,
    pod 0 being the Master; `master` stands for the Master's Service name (no DNS here)."""
    specs = job["spec"]["pytorchReplicaSpecs"]
    nodes = specs["Master"]["replicas"] + specs["Worker"]["replicas"]
    nproc = str(job["spec"]["nprocPerNode"])
    envs = []
    for rank in range(nodes):
        role = "Master" if rank == 0 else "Worker"
        (container,) = specs[role]["template"]["spec"]["containers"]
        envs.append(
            {
                **container_env(container),
                "PET_NNODES": str(nodes),
                "PET_NPROC_PER_NODE": nproc,
                "PET_NODE_RANK": str(rank),
                "PET_MASTER_ADDR": master,
                "PET_MASTER_PORT": str(OPERATOR_PORT),
                "MASTER_ADDR": master,
                "MASTER_PORT": str(OPERATOR_PORT),
                "WORLD_SIZE": str(nodes),
                "RANK": str(rank),
                "PYTHONUNBUFFERED": "1",
            }
        )
    return envs


def indexed_job_env(job: dict[str, Any], master: str) -> list[dict[str, str]]:
    """What each pod of an Indexed Job gets: its container's env and JOB_COMPLETION_INDEX;
    the pod-0 DNS name in GRADMESH_MASTER is replaced by `master` (no DNS here)."""
    (container,) = job["spec"]["template"]["spec"]["containers"]
    env = container_env(container)
    port = env["GRADMESH_MASTER"].rpartition(":")[2]
    env["GRADMESH_MASTER"] = f"{master}:{port}"
    return [{**env, "JOB_COMPLETION_INDEX": str(i)} for i in range(job["spec"]["completions"])]


@pytest.mark.parametrize("name", sorted(p.name for p in MANIFESTS.glob("*.yaml")))
def test_manifests_are_complete(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    docs = manifest(name)
    # every pod's environment places it in the job, as gradmesh reads it
    job = docs.get("PyTorchJob") or docs["Job"]
    envs = (pytorchjob_env if "PyTorchJob" in docs else indexed_job_env)(job, "10.0.0.1")
    for index, env in enumerate(envs):
        with monkeypatch.context() as patch:
            for key, value in env.items():
                patch.setenv(key, value)
            where = cluster_defaults()
        assert (where["node_rank"], where["nnodes"]) == (index, len(envs))
        assert where["master"].partition(":")[0] == "10.0.0.1" and where["iface"] == "eth0"
        assert where["nproc"] >= 1
    gpu = "gpu" in name
    if "PyTorchJob" in docs:
        job = docs["PyTorchJob"]
        assert job["apiVersion"] == "kubeflow.org/v1"
        specs = job["spec"]["pytorchReplicaSpecs"]
        assert set(specs) == {"Master", "Worker"} and specs["Master"]["replicas"] == 1
        (master,) = specs["Master"]["template"]["spec"]["containers"]
        ports = {p["name"]: p["containerPort"] for p in master["ports"]}
        assert ports == {"pytorchjob-port": OPERATOR_PORT}
        containers = [s["template"]["spec"]["containers"] for s in specs.values()]
        assert all(len(c) == 1 and c[0]["name"] == "pytorch" for c in containers)
        containers = [c[0] for c in containers]
    else:
        service, job = docs["Service"], docs["Job"]
        assert service["spec"]["clusterIP"] == "None"
        assert service["spec"]["selector"] == {"job-name": job["metadata"]["name"]}
        spec = job["spec"]
        assert spec["completionMode"] == "Indexed"
        assert spec["completions"] == spec["parallelism"] >= 2
        pod = spec["template"]["spec"]
        assert pod["subdomain"] == service["metadata"]["name"]
        (container,) = pod["containers"]
        env = container_env(container)
        assert int(env["GRADMESH_NNODES"]) == spec["completions"]
        host, _, port = env["GRADMESH_MASTER"].rpartition(":")
        assert host == f"{job['metadata']['name']}-0.{service['metadata']['name']}"
        assert int(port) in [p["port"] for p in service["spec"]["ports"]]
        containers = [container]
    for container in containers:
        assert container["command"][0] == "gradmesh"
        assert container["command"][1] == ("run" if "script" in name else "train")
        assert container_env(container)["GRADMESH_IFACE"] == "eth0"
        resources = container["resources"]
        assert {"cpu", "memory"} <= set(resources["requests"])
        assert ("nvidia.com/gpu" in resources["limits"]) == gpu


@pytest.mark.skipif(namespaces.missing_capability() is not None, reason="no emulated cluster here")
@pytest.mark.parametrize("name", ["pytorchjob-train-cpu.yaml", "indexed-job-train-cpu.yaml"])
def test_a_manifest_s_pods_train_on_the_emulated_cluster(name: str, tmp_path: Path) -> None:
    """One host per pod, each given exactly the environment its pod would get, running the
    manifest's own command (shortened to 5 epochs, the report written here)."""
    docs = manifest(name)
    job = docs.get("PyTorchJob") or docs["Job"]
    if "PyTorchJob" in docs:
        (container,) = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"][
            "containers"
        ]
        make_env = pytorchjob_env
    else:
        (container,) = job["spec"]["template"]["spec"]["containers"]
        make_env = indexed_job_env
    command = list(container["command"])
    command[command.index("--json") + 1] = str(tmp_path / "r.json")
    with EmulatedCluster(2, bandwidth="1gbit") as cluster:
        envs = make_env(job, cluster.address(0))
        assert len(envs) == cluster.hosts
        for env in envs:  # eth0 is the pods' interface; the emulated hosts' is another
            env["GRADMESH_IFACE"] = emulate.IFACE
        job_run = cluster.start([*command, "--epochs", "5"], host_env=lambda h: envs[h])
        code = job_run.wait(240)
    assert code == 0
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["workers"] == 2 and report["test_accuracy"] >= 0.9


def test_kubernetes_variables_that_contradict_flags_are_one_line(
    cli_line: Callable[..., str],
) -> None:
    pod = {"PET_NNODES": "2", "PET_NODE_RANK": "1", "PET_NPROC_PER_NODE": "1"}
    run = ["run", "-np", "1", "--", "true"]
    checks = [
        (
            ["run", "-np", "1", "--node-rank", "0", "--", "true"],
            pod,
            "--node-rank 0 contradicts PET_NODE_RANK=1",
        ),
        (["run", "-np", "2", "--", "true"], pod, "-np 2 contradicts PET_NPROC_PER_NODE=1"),
        (
            run,
            {"PET_NODE_RANK": "1", "GRADMESH_NODE_RANK": "0"},
            "GRADMESH_NODE_RANK=0 and PET_NODE_RANK=1 disagree",
        ),
        (
            run,
            {"GRADMESH_NNODES": "2", "JOB_COMPLETION_INDEX": "x"},
            "JOB_COMPLETION_INDEX='x' is not an integer",
        ),
    ]
    for args, env, message in checks:
        assert message in cli_line(args, **env), (args, env)


def test_engine_input_is_checked_before_anything_starts(cli_line: Callable[..., str]) -> None:
    unknown = cli_line(["train", "--engine", "yarn"])
    assert "unknown engine 'yarn' (valid: local, ray, spark)" in unknown
    ps = cli_line(["train", "--engine", "ray", "--strategy", "ps"])
    assert "--engine ray cannot run --strategy ps" in ps


def _ray_or_spark_processes() -> set[int]:
    names = ("raylet", "gcs_server", "ray::", "org.apache.spark", "pyspark.daemon")
    found = set()
    for proc in psutil.process_iter(["pid", "cmdline"]):
        line = " ".join(proc.info["cmdline"] or [])
        if any(n in line for n in names):
            found.add(proc.info["pid"])
    return found


def _of_another_test(pid: int, tag: str) -> bool:
    """Whether `pid` carries another test's tag (the other test worker may be running the other
    engine's test at the same time: its processes are its own to end)."""
    try:
        other = psutil.Process(pid).environ().get(TAG)
    except psutil.Error:  # gone, or not ours to read
        return False
    return other is not None and other != tag


def _left_behind(before: set[int], tag: str, within_s: float = 30.0) -> set[int]:
    """Engine processes started since `before`, but for another test's, still alive `within_s`
    after the job ended (an engine's workers take a few seconds to end, longer on a busy
    machine)."""
    deadline = time.monotonic() + within_s
    while True:
        left = {p for p in _ray_or_spark_processes() - before if not _of_another_test(p, tag)}
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.2)


EPOCHS = "3"


@pytest.fixture(scope="module")
def local_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The report of the job both engines run, started by gradmesh's own launcher."""
    report = tmp_path_factory.mktemp("local") / "local.json"
    out = gradmesh("train", "--epochs", EPOCHS, "--json", str(report))
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(report.read_text())


def same_model(report: Path, local: dict[str, Any]) -> None:
    """A synchronous strategy with the same seed: the same model, whatever started the ranks."""
    mine = json.loads(report.read_text())
    assert mine["workers"] == 2
    assert mine["test_accuracy"] == local["test_accuracy"]
    assert mine["loss_history"] == local["loss_history"]


def test_spark_trains_what_local_trains_and_names_a_dead_worker(
    local_run: dict[str, Any], tmp_path: Path, no_leaked_processes: str
) -> None:
    pytest.importorskip("pyspark.ml.torch.distributor")
    if shutil.which("java") is None:
        pytest.skip("Spark needs Java (17 or newer)")
    before = _ray_or_spark_processes()
    report = tmp_path / "spark.json"
    own_tmp = {"TMPDIR": str(tmp_path)}  # where torchrun under Spark keeps its agent's folder
    out = gradmesh(
        "train",
        "--engine",
        "spark",
        "--epochs",
        EPOCHS,
        "--json",
        str(report),
        env=own_tmp,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    same_model(report, local_run)
    # a worker killed by SIGKILL: the job fails naming it, and leaves nothing running
    dead = gradmesh(
        "train",
        "--engine",
        "spark",
        "--epochs",
        "1",
        env={"GRADMESH_FAULT": "kill:1:5", **own_tmp},
        timeout=300,
    )
    line = dead.stderr.splitlines()[-1]  # Spark's own log lines come before it
    assert dead.returncode == 2 and line.startswith(
        "gradmesh train: error: spark job failed: rank 1"
    ), line
    assert not _left_behind(before, no_leaked_processes)


def test_ray_trains_what_local_trains_and_names_a_dead_worker(
    local_run: dict[str, Any],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    no_leaked_processes: str,
) -> None:
    """Through the library on one local Ray instance (`gradmesh train --engine ray` calls the
    same `train(config)`, starting its own instance): start-up is most of the cost."""
    before = _ray_or_spark_processes()
    config = TrainConfig.of(engine="ray", epochs=int(EPOCHS), json=str(tmp_path / "ray.json"))
    with kept_environment():  # importing Ray, and its driver, set variables of this process
        ray = pytest.importorskip("ray")
        pytest.importorskip("ray.train.torch")
        from gradmesh.launch.engines import ray as engine

        # Ray's session files in a folder of the test's own (short: Ray puts unix sockets in
        # it), not in /tmp/ray, where every run left them
        own = tempfile.mkdtemp(prefix="gmray-")
        ray.init(num_cpus=2, include_dashboard=False, _temp_dir=own)
        try:
            assert engine.train(config) == 0
            same_model(tmp_path / "ray.json", local_run)
            monkeypatch.setenv("GRADMESH_FAULT", "kill:1:5")  # passed on to Ray's workers
            with pytest.raises(GradmeshError, match=r"^ray job failed: rank 1: its Ray worker"):
                engine.train(TrainConfig.of(engine="ray", epochs=1))
        finally:
            ray.shutdown()
            shutil.rmtree(own, ignore_errors=True)
    assert not _left_behind(before, no_leaked_processes)
