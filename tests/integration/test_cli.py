"""The `gradmesh` command end to end: real launcher, real worker processes, real gloo."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.harness import CLI
from tests.zygote import gradmesh

ROOT = Path(__file__).resolve().parents[2]
GRADMESH = [sys.executable, "-m", "gradmesh.cli"]
REPORT_KEYS = {
    "test_accuracy",
    "final_loss",
    "wall_s",
    "samples_per_s",
    "comm_s",
    "compute_s",
    "bytes_sent",
    "workers",
    "strategy",
    "epochs",
    "seed",
}


def one_line_error(out: subprocess.CompletedProcess[str]) -> str:
    assert out.returncode != 0
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, out.stderr
    assert "Traceback" not in out.stderr
    return lines[0]


def _default_train(report: Path) -> dict[str, Any]:
    started = time.monotonic()
    out = gradmesh("train", "--json", str(report))
    assert time.monotonic() - started < 120  # against hangs; speed is measured by benchmarks
    assert out.returncode == 0, out.stderr
    assert "test accuracy" in out.stdout
    loaded: dict[str, Any] = json.loads(report.read_text())
    return loaded


@pytest.fixture(scope="module")
def default_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The report of `gradmesh train` at its defaults (2 workers, the digits CNN, 12 epochs)."""
    return _default_train(tmp_path_factory.mktemp("default") / "a.json")


def test_default_train_reaches_accuracy_and_is_reproducible(
    tmp_path: Path, default_run: dict[str, Any]
) -> None:
    first, second = default_run, _default_train(tmp_path / "b.json")
    assert set(first) >= REPORT_KEYS
    # seeds 0-5 gave 0.967-0.983 (seed 0, this run's: 0.969): 0.94 keeps 2.7 points below
    assert first["test_accuracy"] >= 0.94
    assert first["workers"] == 2 and first["strategy"] == "allreduce"
    assert first["bytes_sent"] > 0 and first["comm_s"] > 0 and first["compute_s"] > 0
    for key in ("test_accuracy", "final_loss", "loss_history"):
        assert first[key] == second[key]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["train", "--strategy", "nope"],
            "unknown strategy 'nope' (valid: allreduce, diloco, hogwild, local-sgd, ps)",
        ),
        (
            ["train", "--model", "vgg"],
            "unknown model 'vgg' (valid: alexnet, alexnet-imagenet, bag, cnn, gpt, inception3, "
            "linear, mlp, residual, resnet101, resnet50, vgg16)",
        ),
        (
            ["train", "--dataset", "mnist"],
            "unknown dataset 'mnist' (valid: digits, docstrings, synthetic, text)",
        ),
        (
            ["train", "--compression", "zip"],
            "unknown compressor 'zip' (valid: bf16, fp16, int8, none, powersgd, sign, topk)",
        ),
        (
            ["train", "--compression", "topk", "--compression-ratio", "1.5"],
            "--compression-ratio must be in (0, 1], got 1.5",
        ),
        (
            ["train", "--strategy", "hogwild", "--compression", "int8"],
            "hogwild shares memory: it sends nothing to compress",
        ),
        (["train", "--workers", "0"], "--workers must be >= 1"),
        (["plan", "--optimizer", "lamb"], "unknown --optimizer 'lamb' (valid: adam, adamw, sgd)"),
        (["train", "--workers", "4", "--batch-size", "2"], "global batch 2 is smaller"),
        (["train", "--epochs", "many"], "--epochs must be an integer, got 'many'"),
        (["train", "--lr", "fast"], "--lr must be a number, got 'fast'"),
        (
            ["run", "-np", "2", "--", "python", "no/such/script.py"],
            "script no/such/script.py does not exist",
        ),
        (["run", "-np", "0", "--", "python", "-c", "pass"], "-np must be >= 1"),
        (["run", "-np", "1"], "no command to run"),
        (
            ["run", "-np", "1", "--nnodes", "4:2", "--", "python", "-c", "pass"],
            "bad --nnodes '4:2': MIN 4 is more than MAX 2",
        ),
        (
            ["run", "-np", "1", "--nnodes", "1:1", "--", "python", "-c", "pass"],
            "--nnodes MIN:MAX is for jobs over several hosts",
        ),
        (
            ["emulate", "--hosts", "4", "--nnodes", "2:3", "--", "gradmesh", "train"],
            "--nnodes 2:3: MAX must be --hosts (4)",
        ),
        # a result file that cannot be written: once a traceback after the whole benchmark
        (["bench", "allreduce", "--json", "/no/such/r.json"], "the folder /no/such does not"),
        (["simulate", "--json", "/no/such/r.json"], "--json /no/such/r.json: the folder"),
        (["report", "r.json", "--plot", "/no/such/p.png"], "--plot /no/such/p.png: the folder"),
    ],
)
def test_bad_input_gets_one_clear_line(
    args: list[str], message: str, cli_line: Callable[..., str]
) -> None:
    assert message in cli_line(args)


def test_the_command_itself_exits_2_with_the_line() -> None:
    """The installed command, as a user's shell runs it (the cases above run its `main` in
    the test's process)."""
    out = gradmesh("train", "--workers", "0", timeout=60)
    assert out.returncode == 2 and out.stdout == ""
    assert one_line_error(out) == "gradmesh train: error: --workers must be >= 1, got 0"


TOML_CASES = [
    ('workers = "two"', "workers must be an integer, got 'two'"),
    ('lr = "fast"', "lr must be a number, got 'fast'"),
    ("batch_size = [64]", "batch_size must be an integer, got [64]"),
    ("epochs = 2.5", "epochs must be an integer, got 2.5"),
    ("workers = true", "workers must be an integer, got true"),
    ("[train]\nmomentum = 0.9\nnesterov = true", "unknown option(s) nesterov"),
]


@pytest.mark.parametrize(("text", "message"), TOML_CASES)
def test_a_config_of_wrong_types_is_one_line_before_launch(
    text: str, message: str, tmp_path: Path, cli_line: Callable[..., str]
) -> None:
    config = tmp_path / "job.toml"
    config.write_text(text + "\n")
    assert cli_line(["train", "--config", str(config)]) == (
        f"gradmesh train: error: {config}: {message}"
    )


def bad_checkpoint(folder: Path, kind: str) -> Path:
    """A checkpoint of the default run (2 workers, cnn on digits) whose rank 1 file torch loads
    safely but that does not fit the run."""
    import torch

    from gradmesh.data import DATASETS, DataOptions
    from gradmesh.models.registry import build_model
    from gradmesh.train import checkpoint
    from gradmesh.train.config import TrainConfig

    model = build_model("cnn", DATASETS.get("digits")(DataOptions()))
    state: dict[str, object] = {
        "model": model.state_dict(),
        "optimizer": torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9).state_dict(),
        "strategy": {},
        "rng": checkpoint.rng_state(),
        "progress": {"loss_sum": torch.zeros(2, dtype=torch.float64)},
    }
    identity = TrainConfig().identity()
    for rank in (1, 0):
        writer = checkpoint.Checkpointer(str(folder), rank, 2, identity, 3, False, 5)
        writer.save(23, 1, 0, [0.5], 1437, state)
    path = checkpoint.rank_file(checkpoint.folder(folder, 23), 1)
    if kind == "list":
        torch.save([1, 2, 3], path)
    elif kind == "no model":
        torch.save({k: v for k, v in state.items() if k != "model"}, path)
    elif kind == "shapes":
        name = next(iter(model.state_dict()))
        torch.save({**state, "model": {**model.state_dict(), name: torch.zeros(3, 3)}}, path)
    elif kind == "optimizer":
        path = checkpoint.rank_file(checkpoint.folder(folder, 23), 0)
        torch.save({**state, "optimizer": {"state": {}, "param_groups": []}}, path)
    return path


@pytest.mark.parametrize(
    ("kind", "message"),
    [
        ("list", "expected a mapping of checkpoint fields, found list"),
        ("no model", "no 'model' entry"),
        ("shapes", "is [3, 3] torch.float32, the model needs"),
        ("optimizer", "optimizer state: "),
    ],
)
def test_a_checkpoint_of_the_wrong_structure_is_one_line_before_launch(
    kind: str, message: str, tmp_path: Path, cli_line: Callable[..., str]
) -> None:
    """Refused before launch, so `main` in this process is the command's run (exit code 2,
    one line, nothing on stdout: `cli_line`), without a second interpreter importing torch."""
    path = bad_checkpoint(tmp_path / "ckpt", kind)
    line = cli_line(["train", "--checkpoint-dir", str(tmp_path / "ckpt")])
    assert line.startswith(f"gradmesh train: error: checkpoint {path} does not fit this run: ")
    assert message in line and line.endswith("no earlier complete checkpoint to fall back to")


@pytest.mark.parametrize("flag", ["--json", "--timeline", "--checkpoint-dir", "--tensorboard"])
def test_unwritable_outputs_are_refused_before_training(
    flag: str, tmp_path: Path, cli_line: Callable[..., str]
) -> None:
    """Checked at start-up: a run is never trained only to lose its results at the end (exit
    code 2, one line, no report on stdout: `cli_line`, `main` in this process)."""
    afile = tmp_path / "a-file"
    afile.write_text("")
    folder = flag in ("--checkpoint-dir", "--tensorboard")
    target = afile if folder else tmp_path / "missing" / "out.json"
    started = time.monotonic()
    line = cli_line(["train", flag, str(target)])
    assert time.monotonic() - started < 30  # a hang guard
    assert line.startswith(f"gradmesh train: error: {flag} {target}")
    assert "is not a folder" in line or "does not exist" in line


def test_master_port_in_use() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        out = gradmesh(
            "run", "-np", "2", "--master", f"127.0.0.1:{port}", "--", "python", "-c", "pass"
        )
    assert f"master port {port} is already in use" in one_line_error(out)


def test_failing_rank_ends_the_job_with_its_exit_code(tmp_path: Path) -> None:
    """Rank 2 fails once every rank has printed its line (a rank stopped before its first
    line would have nothing to show); the sleeping ranks are stopped and their lines kept."""
    script = tmp_path / "fail.py"
    script.write_text(
        "import os, pathlib, sys, time\n"
        "print('started', flush=True)\n"
        f"here = pathlib.Path({str(tmp_path)!r})\n"
        "(here / ('up' + os.environ['RANK'])).touch()\n"
        "if os.environ['RANK'] == '2':\n"
        "    end = time.monotonic() + 30\n"
        "    while time.monotonic() < end and len(list(here.glob('up*'))) < 3:\n"
        "        time.sleep(0.05)\n"
        "    sys.exit(7)\n"
        "time.sleep(120)\n"
    )
    started = time.monotonic()
    out = gradmesh("run", "-np", "3", "--", "python", str(script))
    assert out.returncode == 7
    assert time.monotonic() - started < 60  # the sleeping ranks were stopped, not waited for
    assert "rank 2 exited with code 7; the job was stopped" in out.stderr
    assert {"[0] started", "[1] started", "[2] started"} <= set(out.stdout.splitlines())


def start_two_workers(tmp_path: Path, prelude: str) -> subprocess.Popen[str]:
    """`gradmesh run -np 2` of a script that runs `prelude`, says 'up' and sleeps; returns once
    both workers are up."""
    script = tmp_path / "hold.py"
    script.write_text(f"{prelude}\nimport time\nprint('up', flush=True)\ntime.sleep(120)\n")
    proc = subprocess.Popen(
        [*GRADMESH, "run", "-np", "2", "--", "python", str(script)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    assert proc.stdout is not None
    assert "up" in proc.stdout.readline() and "up" in proc.stdout.readline()
    return proc


def test_ctrl_c_ends_every_worker(tmp_path: Path) -> None:
    proc = start_two_workers(tmp_path, "import time")
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130
    assert "stopped by SIGINT" in err
    # the leak fixture then checks that no worker survived


def test_example_trains_under_gradmesh_run_and_torchrun(tmp_path: Path) -> None:
    example = str(ROOT / "examples" / "train_digits.py")
    ours = gradmesh("run", "-np", "2", "--", "python", example)
    assert ours.returncode == 0, ours.stderr
    assert "[0] test accuracy" in ours.stdout and "on 2 workers" in ours.stdout
    # torchrun's agent leaves a torchelastic_* folder in the temp dir: keep it in tmp_path too
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp_path)}
    theirs = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--log-dir",  # torchrun leaves its log folder behind; keep it in the test's tmp_path
            str(tmp_path / "torchrun-logs"),
            "--nproc-per-node",
            "2",
            example,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=ROOT,
    )
    assert theirs.returncode == 0, theirs.stderr
    accuracy = float(theirs.stdout.split("test accuracy")[1].split()[0])
    assert accuracy >= 0.9


def test_single_host_job_listens_on_loopback_only(tmp_path: Path) -> None:
    import psutil

    proc = start_two_workers(tmp_path, "import gradmesh, time\ngradmesh.init()")
    try:
        family = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
        listening = [
            c.laddr
            for p in family
            for c in p.net_connections("tcp")
            if c.status == psutil.CONN_LISTEN
        ]
        assert listening  # the rendezvous store and gloo's own listeners
        assert all(addr.ip in ("127.0.0.1", "::1") for addr in listening), listening
    finally:
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=60)


def test_bench_allreduce_writes_every_algorithm(
    tmp_path: Path, cli_line: Callable[..., str]
) -> None:
    out = gradmesh(
        "bench",
        "allreduce",
        "--world",
        "2",
        "--sizes",
        "4KB,64KB",
        "--reps",
        "3",
        "--warmup",
        "1",
        "--json",
        str(tmp_path / "b.json"),
    )
    assert out.returncode == 0, out.stderr
    rows = json.loads((tmp_path / "b.json").read_text())["results"]
    names = {"ring", "tree", "butterfly", "star", "hierarchical", "native"}
    assert {(r["algorithm"], r["bytes"]) for r in rows} == {
        (a, b) for a in names for b in (4096, 65536)
    }
    for r in rows:
        assert r["median_s"] > 0 and r["p90_s"] >= r["median_s"] and r["predicted_s"] > 0
        assert r["busbw_GBps"] == pytest.approx(r["algbw_GBps"])  # 2(p-1)/p = 1 at p = 2
    assert "busbw GB/s" in out.stdout
    assert "unknown allreduce algorithm 'x'" in cli_line(
        ["bench", "allreduce", "--algorithms", "ring,x"]
    )


def test_train_with_another_allreduce_algorithm(tmp_path: Path) -> None:
    out = gradmesh(
        "train",
        "--workers",
        "3",
        "--allreduce",
        "ring",
        "--epochs",
        "6",
        "--json",
        str(tmp_path / "r.json"),
    )
    assert out.returncode == 0, out.stderr
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["strategy_info"]["allreduce"] == "ring" and report["workers"] == 3
    assert report["test_accuracy"] >= 0.9


def test_train_timeline_and_large_batch_rules(
    tmp_path: Path, cli: CLI, capsys: pytest.CaptureFixture[str]
) -> None:
    out = gradmesh(
        "train",
        "--epochs",
        "3",
        "--lr-scaling",
        "linear",
        "--lr",
        "0.025",
        "--warmup-epochs",
        "1",
        "--fusion-mb",
        "0.05",
        "--compression",
        "int8",
        "--timeline",
        str(tmp_path / "t.json"),
        "--tensorboard",
        str(tmp_path / "tb"),
        "--json",
        str(tmp_path / "r.json"),
    )
    assert out.returncode == 0, out.stderr
    trace = json.loads((tmp_path / "t.json").read_text())  # one file for the job
    spans = merged_trace_spans(trace, {0: "rank 0", 1: "rank 1"})
    for rank in (0, 1):
        names = {e["name"] for e in spans[rank]}
        assert {"forward", "backward", "pack", "reduce", "unpack", "step"} <= names
        assert {"compress", "decompress"} <= names
    # clocks aligned: the k-th reduce of each bucket on rank 1 overlaps rank 0's
    reduces = [
        sorted((e for e in spans[r] if e["name"] == "reduce"), key=lambda e: e["ts"])
        for r in (0, 1)
    ]
    by_bucket = [
        {b: [e for e in rs if e["args"]["bucket"] == b] for b in {e["args"]["bucket"] for e in rs}}
        for rs in reduces
    ]
    assert len(by_bucket[0]) >= 2 and by_bucket[0].keys() == by_bucket[1].keys()
    for bucket, mine in by_bucket[1].items():
        theirs = by_bucket[0][bucket]
        assert len(mine) == len(theirs) == 3 * 23  # every step of the 3 epochs
        for a, b in zip(mine, theirs, strict=True):
            assert a["ts"] <= b["ts"] + b["dur"] and b["ts"] <= a["ts"] + a["dur"], (bucket, a, b)
    # half the fastest of 16 round trips on the loopback: 30-45 us when quiet, but each reply
    # can wait for rank 0's main thread (building its model) to let go of the GIL, in 5 ms turns
    # (the overlap of the reduces above is what shows the clocks aligned)
    assert 0 < trace["otherData"]["clock"]["1"]["uncertainty_us"] < 15_000
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["strategy_info"]["compression"] == "int8 with error feedback"
    # one byte per element and a float32 scale per 512 elements: 0.252 of the bytes given
    assert 0.25 < report["compression"]["ratio"] < 0.26
    assert report["final_loss"] < 1.0
    scalars = tensorboard_scalars(tmp_path / "tb")
    per_step = ["loss/rank0_step", "throughput/samples_per_s", "lr", "time/step_s"]
    per_step += ["time/comm_s", "time/compute_s", "bytes/total", "bytes/sync"]
    for tag in per_step:
        assert [s.step for s in scalars[tag]] == list(range(1, 3 * 23 + 1)), tag
    for tag in ("accuracy/test", "loss/epoch_mean"):
        assert [s.step for s in scalars[tag]] == [23, 46, 69], tag
    assert scalars["accuracy/test"][-1].value == pytest.approx(report["test_accuracy"])
    assert [s.value for s in scalars["loss/epoch_mean"]] == pytest.approx(report["loss_history"])
    assert scalars["lr"][0].value < scalars["lr"][-1].value  # the warm-up, step by step
    assert scalars["bytes/sync"][-1].value > 0 and scalars["job/restarts"][0].value == 0
    # `gradmesh report` in this process (`cli`): the command's run without a second interpreter
    capsys.readouterr()
    assert cli(["report", str(tmp_path / "r.json"), "--plot", str(tmp_path / "run.png")]) == 0
    shown = capsys.readouterr().out
    assert shown.startswith("gradmesh train: cnn on digits, strategy allreduce")
    assert (tmp_path / "run.png").read_bytes()[:4] == b"\x89PNG"
    assert cli(["report", str(tmp_path / "t.json"), "--plot", str(tmp_path / "t.png")]) == 0
    shown = capsys.readouterr().out
    for rank in (0, 1):  # the trace's own spans, per step
        line = next(x for x in shown.splitlines() if x.startswith(f"  rank {rank}: "))
        assert line.startswith(f"  rank {rank}: 69 steps; ms per step: backward "), line
    assert (tmp_path / "t.png").read_bytes()[:4] == b"\x89PNG"


def merged_trace_spans(trace: dict, names: dict[int, str]) -> dict[int, list[dict]]:
    """The complete events of a merged trace by pid, after checking that every process in
    `names` is there, named, and that each event is well-formed."""
    events = trace["traceEvents"]
    named = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    assert named == names
    spans: dict[int, list[dict]] = {pid: [] for pid in names}
    for e in events:
        if e["ph"] == "X":
            assert isinstance(e["tid"], int) and e["dur"] >= 0 and e["ts"] > -1e7, e
            spans[e["pid"]].append(e)
    threads = {(e["pid"], e["tid"]) for e in events if e.get("name") == "thread_name"}
    assert {(e["pid"], e["tid"]) for es in spans.values() for e in es} <= threads
    assert trace["otherData"]["missing_ranks"] == []
    return spans


def tensorboard_scalars(logdir: Path) -> dict[str, list]:
    """Every scalar and histogram in the folder's event files (one run, however many
    processes wrote to it), by tag, read with tensorboard's reader."""
    from tensorboard.backend.event_processing.event_multiplexer import EventMultiplexer

    runs = EventMultiplexer().AddRunsFromDirectory(str(logdir))
    runs.Reload()
    (run,) = runs.Runs()
    accumulator = runs.GetAccumulator(run)
    tags = accumulator.Tags()
    found = {tag: accumulator.Scalars(tag) for tag in tags["scalars"]}
    return found | {tag: accumulator.Histograms(tag) for tag in tags["histograms"]}


def test_horovod_script_runs_with_only_its_import_changed() -> None:
    out = gradmesh("run", "-np", "2", "--", "python", str(ROOT / "examples" / "horovod_digits.py"))
    assert out.returncode == 0, out.stderr
    accuracy = float(out.stdout.split("test accuracy")[1].split()[0])
    assert accuracy >= 0.9


def test_horovod_scripts_with_sets_objects_join_and_elastic_state_run_unchanged() -> None:
    """Three Horovod-style scripts beyond the plain one, each under `gradmesh run -np 2`."""
    outputs = {}
    for script in ("horovod_process_sets.py", "horovod_uneven.py", "horovod_elastic.py"):
        out = gradmesh("run", "-np", "2", "--", "python", str(ROOT / "examples" / script))
        assert out.returncode == 0, out.stderr
        outputs[script] = out.stdout
    sets = outputs["horovod_process_sets.py"]
    assert "wide (ranks [0]) test accuracy" in sets and "deep (ranks [1]) test accuracy" in sets
    uneven = outputs["horovod_uneven.py"]
    # rank 1 holds twice rank 0's data: rank 0 joined early and kept stepping with rank 1
    assert "rank 0: 479 samples, 60 steps" in uneven and "rank 1: 958 samples, 120 steps" in uneven
    assert "digits (8x8): replicas identical True" in uneven
    elastic = outputs["horovod_elastic.py"]
    assert float(elastic.split("test accuracy")[1].split()[0]) >= 0.9


def test_bench_horovod_synthetic_times_the_drop_in_against_gradmesh_and_ddp(
    tmp_path: Path, cli_line: Callable[..., str]
) -> None:
    out = gradmesh(
        "bench",
        "horovod-synthetic",
        "--model",
        "cnn",
        "--image-size",
        "16",
        "--batch-size",
        "8",
        "--rounds",
        "2",
        "--batches-per-round",
        "2",
        "--json",
        str(tmp_path / "h.json"),
    )
    assert out.returncode == 0, out.stderr
    result = json.loads((tmp_path / "h.json").read_text())
    images = result["images_per_s"]
    assert set(images) == set(result["step_s"]) == {"horovod", "gradmesh", "ddp"}
    for name, step_s in result["step_s"].items():
        assert images[name] == pytest.approx(16 / step_s)  # 2 workers x 8 images
        assert 0.0 <= result["cpu_idle"][name] <= 1.0
        assert result["limit"][name] in ("cpu", "loopback")
    assert result["horovod_over_gradmesh"] == pytest.approx(images["horovod"] / images["gradmesh"])
    assert result["target_met"] == (result["horovod_over_gradmesh"] >= 0.95)
    assert "drop-in / gradmesh" in out.stdout
    line = cli_line(["bench", "horovod-synthetic", "--image-size", "12"])
    assert "--image-size must be a multiple of 8" in line


def test_bench_dataparallel_compares_with_ddp(tmp_path: Path) -> None:
    out = gradmesh(
        "bench",
        "dataparallel",
        "--world",
        "2",
        "--steps",
        "3",
        "--rounds",
        "2",
        "--json",
        str(tmp_path / "d.json"),
    )
    assert out.returncode == 0, out.stderr
    got = json.loads((tmp_path / "d.json").read_text())
    assert set(got) >= {"world", "model", "gradmesh_step_s", "ddp_step_s", "ratio"}
    assert got["ratio"] == pytest.approx(got["gradmesh_step_s"] / got["ddp_step_s"])


def test_bench_compression_measures_each_engine_against_none_and_torch(
    tmp_path: Path, cli_line: Callable[..., str]
) -> None:
    engines = "none,int8,powersgd,torch-powersgd"
    out = gradmesh(
        "bench",
        "compression",
        "--model=mlp",
        f"--engines={engines}",
        "--max-epochs=1",
        "--min-rounds=1",
        "--chunk=5",
        "--json",
        str(tmp_path / "c.json"),
    )
    assert out.returncode == 0, out.stderr
    got = json.loads((tmp_path / "c.json").read_text())
    runs = got["engines"]
    assert list(runs) == engines.split(",")
    for r in runs.values():
        assert r["wire_bytes_per_step"] is None and r["limit"] in ("loopback", "cpu")
        assert r["steps"] == got["steps_per_epoch"] and r["timed_turns"] >= 1
    # gradmesh's own byte counts: int8 sends a byte per element and a scale per 512
    int8 = runs["int8"]["counted_bytes_per_step"] / runs["none"]["counted_bytes_per_step"]
    assert 0.24 < int8 < 0.27
    assert runs["int8"]["speedup"] == pytest.approx(runs["none"]["step_s"] / runs["int8"]["step_s"])
    ratio = runs["powersgd"]["step_s"] / runs["torch-powersgd"]["step_s"]
    assert got["powersgd_vs_torch_step_ratio"] == pytest.approx(ratio)
    assert set(got["targets"]) >= {"int8_speedup>=2.5", "powersgd_step_vs_torch<=1.05"}
    assert "unknown engine 'zip' (valid: none, " in cli_line(
        ["bench", "compression", "--engines=none,zip"]
    )


def test_local_sgd_sends_an_eighth_of_the_bytes_and_still_learns(
    tmp_path: Path, default_run: dict[str, Any], cli_line: Callable[..., str]
) -> None:
    local = gradmesh(
        "train",
        "--strategy",
        "local-sgd",
        "--sync-every",
        "8",
        "--json",
        str(tmp_path / "local.json"),
    )
    assert local.returncode == 0, local.stderr
    a, b = json.loads((tmp_path / "local.json").read_text()), default_run
    assert a["test_accuracy"] >= 0.95
    assert a["bytes_sent"] <= 0.15 * b["bytes_sent"]
    assert a["strategy_info"]["averaging_rounds"] == 12 * 23 // 8
    assert "--sync-every must be >= 1" in cli_line(
        ["train", "--strategy", "local-sgd", "--sync-every", "0"]
    )


def test_hogwild_trains_the_sparse_problem_and_counts_updates(
    tmp_path: Path, cli_line: Callable[..., str]
) -> None:
    out = gradmesh(
        "train",
        "--strategy=hogwild",
        "--dataset=docstrings",
        "--model=bag",
        "--momentum=0",
        "--lr=0.5",
        "--batch-size=64",
        "--epochs=6",
        "--lock",
        "--tensorboard",
        str(tmp_path / "tb"),
        "--json",
        str(tmp_path / "h.json"),
    )
    assert out.returncode == 0, out.stderr
    got = json.loads((tmp_path / "h.json").read_text())
    assert got["test_accuracy"] >= 0.7  # 10 packages: chance is about 0.14
    from gradmesh.data import DATASETS, DataOptions

    steps_per_epoch = -(-len(DATASETS.get("docstrings")(DataOptions()).train) // 64)
    assert got["strategy_info"]["updates_applied"] == 2 * 6 * steps_per_epoch
    assert got["strategy_info"]["lock"] is True
    scalars = tensorboard_scalars(tmp_path / "tb")
    (updates,) = scalars["hogwild/updates_applied"]
    assert updates.value == got["strategy_info"]["updates_applied"]
    epochs = [s.step for s in scalars["loss/epoch_mean"]]
    assert epochs == [(e + 1) * steps_per_epoch for e in range(6)]
    assert got["bytes_sent"] < 10_000  # no weights cross a socket, only the loss sums
    assert "needs real-valued inputs" in cli_line(
        ["train", "--strategy=hogwild", "--dataset=docstrings", "--model=cnn"]
    )


def test_bench_hogwild_writes_the_results_table(tmp_path: Path) -> None:
    out = gradmesh(
        "bench",
        "hogwild",
        "--workers=1,2",
        "--modes=hogwild",
        "--problems=sparse",
        "--rounds=1",
        "--epochs=2",
        "--json",
        str(tmp_path / "b.json"),
    )
    assert out.returncode == 0, out.stderr
    got = json.loads((tmp_path / "b.json").read_text())
    rows = {(r["workers"], r["mode"]): r for r in got["results"]}
    assert set(rows) == {(1, "hogwild"), (2, "hogwild")}
    for row in rows.values():
        assert row["samples_per_s"] > 0 and 0.2 < row["test_accuracy"] <= 1.0
    (speedup,) = got["speedup"]
    assert speedup["speedup"] == pytest.approx(
        rows[(2, "hogwild")]["samples_per_s"] / rows[(1, "hogwild")]["samples_per_s"]
    )
    assert "unknown mode 'fast'" in gradmesh("bench", "hogwild", "--modes=fast").stderr


def test_bench_ps_micro_measures_a_server_process_per_shard_size(
    tmp_path: Path, cli_line: Callable[..., str]
) -> None:
    out = gradmesh(
        "bench", "ps", "--micro", "--sizes=64KB,256KB", "--seconds=0.2", "--rounds=1",
        "--json", str(tmp_path / "m.json"),
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    rows = json.loads((tmp_path / "m.json").read_text())["results"]
    assert [r["shard_bytes"] for r in rows] == [64 << 10, 256 << 10]
    for row in rows:
        assert row["requests_per_window"][0] > 0
        # the server's CPU is its own process's (a second process: it cannot be this one's)
        assert 0 < row["server_cpu_us_per_push_pull"] < row["round_trip_us"] * 4
    assert "--sizes" in cli_line(["bench", "ps", "--micro", "--sizes=3"])
