"""The emulated cluster: real namespaces, shaped links, multi-node launches, faults, clean-up."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gradmesh.bench.harness import CPU_BOUND_IDLE
from gradmesh.launch import namespaces
from gradmesh.launch.emulate import EmulatedCluster, HostJob
from tests import zygote

ROOT = Path(__file__).resolve().parents[2]
GRADMESH = [sys.executable, "-m", "gradmesh.cli"]
WHY = namespaces.missing_capability()
pytestmark = pytest.mark.skipif(WHY is not None, reason=WHY or "")


def gradmesh(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return zygote.gradmesh(*args, timeout=timeout)


def test_bench_link_measures_a_shaped_link(tmp_path: Path) -> None:
    out = gradmesh(
        "bench",
        "link",
        "--hosts",
        "2",
        "--bandwidth",
        "200mbit",
        "--bytes",
        "4MB",
        "--reps",
        "3",
        "--warmup",
        "1",
        "--json",
        str(tmp_path / "l.json"),
    )
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads((tmp_path / "l.json").read_text())
    assert set(got) >= {
        "hosts",
        "bandwidth_bps",
        "bytes",
        "median_s",
        "busbw_Bps",
        "link_utilization",
    }
    assert got["bandwidth_bps"] == 200_000_000
    # shaped: an unshaped veth would carry several Gbit/s, far above the 200 Mbit/s asked for
    assert 0.3 < got["link_utilization"] < 1.1


def test_the_simulator_predicts_a_scaling_point_of_the_study(tmp_path: Path) -> None:
    """Issue 16's check on a small configuration (the full study, every strategy at 1 to 4
    hosts, is in docs/scaling.md): the asynchronous parameter server, the strategy the model
    once priced worst, on 2 emulated hosts at 1 Gbit/s (and a host for its server), next to the
    simulator's prediction from the job's own compute and the probed links. Compute is EMULATED
    (20 ms of sleep per step over the real arithmetic) so the links, not the 2 cores, bound it.
    One strategy only. The benchmark run alone meets +-3 % (docs/scaling.md); in the suite it
    shares 2 cores with another test worker, which stretched a step 10.2 % past the prediction
    on a busy CI machine while the idle CPU still read "link", so the bound here is 25 %: wide
    enough for a neighbour, narrow enough to catch a model that forgot a term (the gradient push
    alone is about 15 % of the step)."""
    out = gradmesh(
        "bench",
        "scaling",
        "--strategies",
        "ps",
        "--hosts",
        "2",
        "--rounds",
        "1",
        "--epochs",
        "2",
        "--emulate-compute",
        "20",
        "--json",
        str(tmp_path / "s.json"),
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads((tmp_path / "s.json").read_text())
    assert got["compute"].startswith("EMULATED")
    assert got["links"]["2"]["point_to_point"]["beta"] > 0  # the ps link: a loaded ping-pong
    (point,) = got["strategies"]["ps"]
    assert point["hosts"] == 2 and point["limit"] in ("link", "cpu"), point
    assert point["bytes_per_worker_step"] > 100e3  # the CNN's 150 KB gradient pushed each step
    assert point["compute_step_s"] >= 0.020  # the sleep is in the step's compute
    # the label says what bound the step, from the machine's idle CPU during it
    assert (point["limit"] == "cpu") == (point["cpu_idle"] < CPU_BOUND_IDLE), point
    if point["limit"] == "cpu":  # a busy machine: the figure is the cores', not the link's
        pytest.skip(f"the cores bound the step (idle {point['cpu_idle']:.2f}): no link figure")
    assert abs(point["prediction_error"]) <= 0.25, point


ALLREDUCE_LOOP = (
    "import gradmesh, torch, time\n"
    "from gradmesh.collectives import allreduce\n"
    "gradmesh.init()\n"
    "print('up', flush=True)\n"
    "for _ in range({n}):\n"
    "    allreduce(torch.ones(1 << 18))\n"
    "    time.sleep({pause})\n"
)
REDUCING_LOOP = ALLREDUCE_LOOP.replace(
    "    time.sleep({pause})\n",
    "    open(f'{marks}/reducing-{{gradmesh.rank()}}', 'w').close()\n    time.sleep({pause})\n",
)
"""ALLREDUCE_LOOP that also marks, in folder `marks`, each rank that has finished an allreduce."""


def wait_until_reducing(marks: Path, job: HostJob, ranks: int, timeout: float = 120) -> None:
    """Until every rank has finished an allreduce (its mark in `marks`): a condition, not a
    fixed sleep that a slow machine could outlast. Fails if a host ends first or it takes
    longer than `timeout`."""
    deadline = time.monotonic() + timeout
    while len(list(marks.glob("reducing-*"))) < ranks:
        ended = [i for i, p in enumerate(job.procs) if p.poll() is not None]
        assert not ended, f"hosts {ended} ended before every rank was reducing"
        assert time.monotonic() < deadline, (
            f"only {sorted(m.name for m in marks.glob('reducing-*'))} of {ranks} ranks "
            f"finished an allreduce within {timeout:.0f} s"
        )
        time.sleep(0.05)


def test_cluster_api_counts_bytes_and_survives_nothing(tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text(ALLREDUCE_LOOP.format(n=4, pause=0))
    with EmulatedCluster(hosts=2, bandwidth="1gbit") as cluster:
        names = [cluster.namespace(h) for h in range(2)]
        assert set(names) <= set(namespaces.our_namespaces())
        before = cluster.bytes_sent(0)
        assert cluster.run(["python", str(script)], timeout=120) == 0
        # 4 native allreduces of 1 MiB on 2 ranks: each rank sends >= 4 x 1 MiB
        assert cluster.bytes_sent(0) - before >= 4 << 20
    assert not set(names) & set(namespaces.our_namespaces())


def test_a_killed_host_ends_the_job_and_leaves_nothing(tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text(REDUCING_LOOP.format(n=10_000, pause=0.01, marks=tmp_path))
    with EmulatedCluster(hosts=2, bandwidth="1gbit") as cluster:
        job = cluster.start(["gradmesh", "run", "--timeout", "5", "--", "python", str(script)])
        wait_until_reducing(tmp_path, job, ranks=2)
        cluster.kill_host(1)
        started = time.monotonic()
        code = job.wait(timeout=60)
        assert code != 0
        assert time.monotonic() - started < 60
    assert not [n for n in namespaces.our_namespaces() if cluster.run_id in n]


def test_an_unplugged_link_fails_within_the_timeout(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """A link that goes down ends a synchronous job soon after the timeout (not torch's 30
    minutes), naming the rank and the operation."""
    script = tmp_path / "job.py"
    script.write_text(REDUCING_LOOP.format(n=10_000, pause=0.01, marks=tmp_path))
    with EmulatedCluster(hosts=2, bandwidth="1gbit") as cluster:
        job = cluster.start(["gradmesh", "run", "--timeout", "4", "--", "python", str(script)])
        wait_until_reducing(tmp_path, job, ranks=2)
        cluster.set_link(1, up=False)
        unplugged = time.monotonic()
        while all(p.poll() is None for p in job.procs) and time.monotonic() - unplugged < 60:
            time.sleep(0.05)
        ended = time.monotonic() - unplugged
        assert job.wait(timeout=90) != 0
    assert ended <= 4 + 15, f"the first host ended {ended:.1f} s after the link went down"
    err = capfd.readouterr().err
    assert re.search(r"rank [01]: native allreduce #\d+ on world: ", err), err[-2000:]


def test_an_elastic_job_loses_a_host_and_finishes_on_the_others(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """4 hosts, --nnodes 2:4: one host's namespace is killed mid-training; the other three
    re-form the job, resume from the newest checkpoint with the same global batch (two
    micro-batches each), and end within a point of the uninterrupted run's accuracy."""
    train = ["gradmesh", "train", "--checkpoint-every", "10", "--max-restarts", "2"]
    # the uninterrupted run: the same job as 4 workers on one host (4 emulated hosts take twice
    # as long to start)
    out = gradmesh("train", "--workers", "4", "--json", str(tmp_path / "a.json"))
    assert out.returncode == 0, out.stderr[-2000:]
    with EmulatedCluster(hosts=4, bandwidth="1gbit") as cluster:
        run = [*train, "--checkpoint-dir", str(tmp_path / "b"), "--json", str(tmp_path / "b.json")]
        job = cluster.start(run, min_hosts=2)
        deadline = time.monotonic() + 120
        while not (tmp_path / "b" / "step-00000040" / "meta.json").exists():
            assert time.monotonic() < deadline and all(p.poll() is None for p in job.procs)
            time.sleep(0.05)
        cluster.kill_host(3)
        assert job.wait(timeout=300) == 0
    a = json.loads((tmp_path / "a.json").read_text())
    b = json.loads((tmp_path / "b.json").read_text())
    assert a["workers"] == 4 and a["test_accuracy"] >= 0.95
    # the same global batch from the same checkpoint: equal but for the summation order of 3
    # ranks and two micro-batches against 4 ranks, which 300 steps amplify to a few test images
    assert b["workers"] == 3 and abs(b["test_accuracy"] - a["test_accuracy"]) <= 0.02
    membership = b["faults"]["membership"]
    assert membership[0] == [0, 4] and membership[-1][1] == 3 and membership[-1][0] >= 40
    assert len(b["loss_history"]) == len(a["loss_history"])
    captured = capfd.readouterr()
    assert "gradmesh emulate: host 3 was lost (killed by SIGKILL)" in captured.err
    assert f"workers (elastic): 4 from step 0, 3 from step {membership[-1][0]}" in captured.out


def test_ctrl_c_tears_everything_down(tmp_path: Path) -> None:
    script = tmp_path / "hold.py"
    script.write_text("import time\nprint('up', flush=True)\ntime.sleep(300)\n")
    proc = subprocess.Popen(
        [*GRADMESH, "emulate", "--hosts", "2", "--", "python", str(script)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        # a suite started in the background inherits SIGINT ignored: Ctrl-C must reach it
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # noqa: PLW1509
    )
    assert proc.stdout is not None
    assert "up" in proc.stdout.readline() and "up" in proc.stdout.readline()
    # this run's own (named by its pid): the other test worker may have a cluster up
    own = f"{namespaces.PREFIX}{proc.pid}x"
    mine = lambda: [n for n in namespaces.our_namespaces() if n.startswith(own)]  # noqa: E731
    assert len(mine()) >= 3
    proc.send_signal(signal.SIGINT)
    proc.communicate(timeout=60)
    assert proc.returncode == 130
    assert not mine()


def test_stale_namespaces_of_dead_runs_are_removed() -> None:
    stale = f"{namespaces.PREFIX}999999999x0000-h0"  # no such pid
    subprocess.run(["ip", "netns", "add", stale], check=True)
    assert stale in namespaces.remove_stale()
    assert stale not in namespaces.our_namespaces()


def test_latency_without_netem_is_said_not_failed() -> None:
    with EmulatedCluster(hosts=2, latency="1ms") as cluster:
        if namespaces.netem_available():
            assert cluster.notes == []
        else:
            assert cluster.notes == [
                "netem is not available on this kernel: --latency is not applied"
            ]


def test_bad_emulate_input_is_one_line() -> None:
    out = gradmesh("emulate", "--hosts", "2", "--bandwidth", "fast", "--", "gradmesh", "train")
    assert out.returncode == 2
    assert out.stderr.strip() == (
        "gradmesh emulate: error: bad bandwidth 'fast': expected a rate like 1gbit or 100mbit"
    )


def test_the_host_whose_rank_failed_is_named(tmp_path: Path) -> None:
    """Host 1's rank raises; host 0's rank only stops because of it: host 1 is named."""
    script = tmp_path / "job.py"
    script.write_text(
        ALLREDUCE_LOOP.format(n=3, pause=0)
        + "if gradmesh.rank() == 1:\n    raise SystemExit(5)\n"
        + "allreduce(torch.ones(4))\n"
    )
    started = time.monotonic()
    out = gradmesh("emulate", "--hosts", "2", "--", "python", str(script), timeout=120)
    assert out.returncode == 5
    assert time.monotonic() - started < 60
    lines = out.stderr.strip().splitlines()
    assert "[h1] gradmesh run: rank 1 exited with code 5; the job was stopped" in lines
    assert lines[-1] == "gradmesh emulate: host 1 failed (exit code 5)"


def test_bench_replicas_compresses_the_average_across_groups(tmp_path: Path) -> None:
    """Two replica groups on emulated hosts, 20 steps: int8 across the groups sends about a
    quarter of the bytes, the groups stay bit-equal, each figure is labelled by its limit."""
    bad = gradmesh("bench", "replicas", "--methods", "int8")
    assert bad.returncode != 0 and "--methods must start with none" in bad.stderr
    bad = gradmesh("bench", "replicas", "--methods", "none,diloco:ten:int8")
    assert bad.returncode != 0
    assert "'diloco:ten:int8': expected diloco:H:COMPRESSOR, like diloco:10:int8" in bad.stderr
    out = tmp_path / "replicas.json"
    done = gradmesh(
        "bench", "replicas", "--groups", "2", "--steps", "20", "--methods", "none,int8",
        "--json", str(out),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(out.read_text())["methods"]
    assert got["none"]["bytes_ratio"] == 1 and 3.5 < got["int8"]["bytes_ratio"] < 4.1
    for run in got.values():
        assert run["bit_equal"] and run["limit"] in ("cpu", "link", "compute")
    assert abs(got["int8"]["loss_gap"]) < 0.02


def test_bench_diloco_compares_bytes_loss_and_time_to_a_loss(tmp_path: Path) -> None:
    """Two emulated hosts, 40 steps, H = 10 with int8, both from the weights of 20 synchronous
    steps: both runs score the test split every 10 steps, below where the pretraining ended;
    DiLoCo's bytes a step are a small fraction of synchronous training's."""
    bad = gradmesh("bench", "diloco", "--sync-every", "10", "--eval-every", "15")
    assert bad.returncode != 0
    assert "--eval-every 15 must be a multiple of --sync-every 10" in bad.stderr
    out = tmp_path / "diloco.json"
    done = gradmesh(
        "bench", "diloco", "--hosts", "2", "--steps", "40", "--sync-every", "10",
        "--bandwidth", "100mbit", "--pretrain-steps", "20", "--json", str(out),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(out.read_text())
    assert got["pretrained"]["steps"] == 20
    assert (
        got["strategies"]["allreduce"]["eval_history"][0]["test_loss"]
        < got["pretrained"]["test_loss"]
    )  # from the pretrained weights, not a fresh model
    for name in ("allreduce", "diloco"):
        run = got["strategies"][name]
        assert [e["step"] for e in run["eval_history"]] == [10, 20, 30, 40]
        seconds = [e["seconds"] for e in run["eval_history"]]
        assert seconds == sorted(seconds) and seconds[0] > 0
        assert run["eval_history"][-1]["test_loss"] == pytest.approx(run["test_loss"])
        assert run["limit"] in ("cpu", "link", "compute")
    # int8 of the change once every 10 steps, the first broadcast included: about 26x fewer
    assert got["comparison"]["bytes_ratio"] > 10
    assert got["comparison"]["target_loss"] == max(
        got["strategies"][s]["test_loss"] for s in ("allreduce", "diloco")
    )
