"""The pure pieces of failing fast: typed config values, checkpoint structure, call signatures,
which failure the launcher names, and one-line library messages."""

from __future__ import annotations

import signal
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from gradmesh.collectives.agreement import describe, encode
from gradmesh.errors import (
    PEER_FAILED_EXIT,
    GradmeshError,
    PeerFailure,
    first_line,
    on_rank,
    torch_collective_failure,
)
from gradmesh.launch.run import _failure_message, _first_failure
from gradmesh.options import convert, option_named
from gradmesh.train import checkpoint
from gradmesh.train.config import TrainConfig, check_writable


@pytest.mark.parametrize(
    ("name", "value", "source", "want"),
    [
        ("workers", 3, "f.toml", 3),
        ("workers", "3", None, 3),
        ("lr", 1, "f.toml", 1.0),
        ("lr", "0.5", None, 0.5),
        ("json", None, "f.toml", None),
        ("lock", True, "f.toml", True),
    ],
)
def test_field_values_of_the_right_type_pass(name: str, value: Any, source: Any, want: Any) -> None:
    got = convert(option_named(TrainConfig, name), value, source)
    assert got == want and type(got) is type(want)


@pytest.mark.parametrize(
    ("name", "value", "source", "message"),
    [
        ("workers", "two", "f.toml", "f.toml: workers must be an integer, got 'two'"),
        ("workers", "3", "f.toml", "f.toml: workers must be an integer, got '3'"),
        ("workers", True, "f.toml", "f.toml: workers must be an integer, got true"),
        ("epochs", 2.5, "f.toml", "f.toml: epochs must be an integer, got 2.5"),
        ("batch_size", [64], "f.toml", "f.toml: batch_size must be an integer, got [64]"),
        ("lr", "fast", None, "--lr must be a number, got 'fast'"),
        ("lr", "nan", None, "--lr must be a finite number, got nan"),
        ("momentum", "-inf", None, "--momentum must be a finite number, got -inf"),
        ("lr", float("inf"), "f.toml", "f.toml: lr must be a finite number, got inf"),
        ("lock", 1, "f.toml", "f.toml: lock must be true or false, got 1"),
        ("model", 3, "f.toml", "f.toml: model must be a string, got 3"),
    ],
)
def test_field_values_of_the_wrong_type_are_one_line(
    name: str, value: Any, source: Any, message: str
) -> None:
    with pytest.raises(GradmeshError) as err:
        convert(option_named(TrainConfig, name), value, source)
    assert str(err.value) == message


def test_a_number_under_its_options_least_is_one_line_from_a_flag_or_a_file() -> None:
    from gradmesh.bench.memory import Config

    batch, warmup = option_named(Config, "batch"), option_named(Config, "warmup")
    for value, source, message in (
        ("0", None, "--batch must be >= 1, got 0"),
        (-2, "f.toml", "f.toml: batch must be >= 1, got -2"),
    ):
        with pytest.raises(GradmeshError) as err:
            convert(batch, value, source)
        assert str(err.value) == message
    assert convert(warmup, "0", None) == 0 and convert(batch, 1, "f.toml") == 1


def test_a_json_config_goes_through_the_same_checks() -> None:
    with pytest.raises(GradmeshError, match="--config: epochs must be an integer, got 2.5"):
        TrainConfig.from_mapping({"epochs": 2.5}, "--config")


def test_output_paths(tmp_path: Path) -> None:
    check_writable(str(tmp_path / "out.json"), "--json")
    check_writable(str(tmp_path / "new" / "ckpt"), "--checkpoint-dir", directory=True)
    assert (tmp_path / "new" / "ckpt").is_dir()
    with pytest.raises(GradmeshError, match="is a folder, not a file"):
        check_writable(str(tmp_path), "--json")
    with pytest.raises(GradmeshError, match="the folder .*/nope does not exist"):
        check_writable(str(tmp_path / "nope" / "t.json"), "--timeline")


def _saved(tmp_path: Path, state: object) -> Path:
    path = tmp_path / "rank-00000.pt"
    torch.save(state, path)
    return path


def _good(model: torch.nn.Module) -> dict[str, Any]:
    return {
        "model": model.state_dict(),
        "optimizer": {},
        "strategy": {},
        "rng": {"torch": torch.get_rng_state()},
        "progress": {},
    }


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        (lambda s: [1, 2], "expected a mapping of checkpoint fields, found list"),
        (lambda s: {k: v for k, v in s.items() if k != "model"}, "no 'model' entry"),
        (lambda s: {**s, "rng": "one"}, "'rng' is a str, not a mapping"),
        (lambda s: {**s, "rng": {}}, "'rng' has no 'torch' generator state"),
        (lambda s: {**s, "model": {}}, "missing model entry 'bias'"),
        (
            lambda s: {**s, "model": {**s["model"], "extra": torch.zeros(1)}},
            "the model has no 'extra'",
        ),
        (
            lambda s: {**s, "model": {**s["model"], "weight": torch.zeros(3)}},
            "model entry 'weight' is [3] torch.float32, the model needs [2, 4] torch.float32",
        ),
    ],
)
def test_a_checkpoint_that_does_not_fit_is_one_line_naming_the_file(
    tmp_path: Path, change: Any, problem: str
) -> None:
    model = torch.nn.Linear(4, 2)
    path = _saved(tmp_path, change(_good(model)))
    with pytest.raises(GradmeshError) as err:
        checkpoint.read_rank(tmp_path, 0, model)
    assert str(err.value).startswith(f"checkpoint {path} does not fit this run: ")
    assert problem in str(err.value) and "\n" not in str(err.value)


def test_signatures_describe_shape_dtype_and_a_different_operation() -> None:
    mine = encode(7, "ring allreduce\0", torch.ones(2, 3))
    theirs = encode(7, "tree broadcast\0", torch.ones(3, 2, dtype=torch.float64))
    assert describe(mine, mine, 0) == "call #7 of 2x3 float32"
    assert describe(theirs, mine, 0) == (
        "call #7 of 3x2 float64, another operation or name than rank 0"
    )
    assert describe(encode(1, "x", torch.ones(1, 1, 1, 1, 1, 2)), mine, 0).startswith(
        "call #1 of 6-d with 2 elements"
    )
    assert describe(encode(1, "ring allreduce\0", torch.tensor(1.0)), mine, 0) == (
        "call #1 of scalar float32"
    )


def failure(exitcode: int, timestamp: int) -> Any:
    return SimpleNamespace(exitcode=exitcode, timestamp=timestamp)


def test_the_launcher_names_the_cause_not_the_casualties() -> None:
    killed = -signal.SIGKILL
    stopped = -signal.SIGTERM
    # rank 0 stopped on its peer's death in the same second as rank 1 was killed: rank 1
    assert _first_failure({0: failure(PEER_FAILED_EXIT, 5), 1: failure(killed, 5)})[0] == 1
    # rank 0 exited with 3; rank 1 was ended by the agent afterwards: rank 0
    assert _first_failure({0: failure(3, 9), 1: failure(stopped, 9)})[0] == 0
    # only casualties: the earliest of them
    assert (
        _first_failure({0: failure(PEER_FAILED_EXIT, 9), 1: failure(PEER_FAILED_EXIT, 8)})[0] == 1
    )
    # a rank stopped on a peer's failure is named before one the agent ended
    assert _first_failure({0: failure(stopped, 1), 1: failure(PEER_FAILED_EXIT, 2)})[0] == 1


def test_a_failed_rank_is_named_with_its_role(tmp_path: Path) -> None:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    died = ProcessFailure(0, 1, -signal.SIGKILL, str(tmp_path / "no-error-file"))
    exc = ChildFailedError("gradmesh", {0: died})
    roles = {0: "parameter server 0", 1: "ps worker 0"}
    assert _failure_message(exc, 0, roles) == (
        "rank 0 (parameter server 0) was killed by signal SIGKILL; the job was stopped",
        137,
    )
    assert _failure_message(exc, 2)[0] == (
        "rank 0 was killed by signal SIGKILL; the job was stopped after 2 restart(s)"
    )


def test_library_messages_become_one_readable_line() -> None:
    gloo = RuntimeError(
        "[/__w/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by "
        "peer [127.0.0.1]:43944. This is typically caused by a remote worker crashing.\nmore"
    )
    assert first_line(gloo) == "Connection closed by peer [127.0.0.1]:43944"
    assert (
        on_rank(2, GradmeshError("rank 2: ring allreduce #1: x")) == "rank 2: ring allreduce #1: x"
    )
    assert on_rank(2, GradmeshError("bad shape")) == "rank 2: bad shape"


GLOO = (
    "[/w/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:40607: "
    "Connection reset by peer. This is typically caused by a remote worker hanging"
)
C10D = "/site-packages/torch/distributed/distributed_c10d.py"
FSDP = "/site-packages/torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py"


def _module(path: str, source: str, **names: Any) -> dict[str, Any]:
    """Functions whose frames say they are in `path` (as torch's own are)."""
    scope: dict[str, Any] = dict(names)
    exec(compile(source, path, "exec"), scope)
    return scope


def test_torchs_own_collectives_failing_on_a_lost_peer_are_one_line() -> None:
    """FSDP2's and ZeroRedundancyOptimizer's collectives are torch's: a Gloo error under them
    becomes a `PeerFailure` naming the rank and the operation (a worker prints it as its one
    line, where it printed a traceback); other errors are left alone."""
    c10d = _module(C10D, f"def all_gather_single():\n    raise RuntimeError({GLOO!r})\n")
    fsdp = _module(FSDP, "def foreach_all_gather():\n    all_gather_single()\n", **c10d)
    with pytest.raises(RuntimeError) as under_fsdp:
        fsdp["foreach_all_gather"]()
    failure = torch_collective_failure(under_fsdp.value, 0)
    assert isinstance(failure, PeerFailure)
    assert str(failure) == (
        "rank 0: all_gather_single of FSDP2 (--zero-stage 2 or 3) failed: Read error "
        "[127.0.0.1]:40607: Connection reset by peer"
    )
    with pytest.raises(RuntimeError) as alone:
        c10d["all_gather_single"]()
    assert str(torch_collective_failure(alone.value, 3)).startswith(
        "rank 3: all_gather_single failed: Read error"
    )
    # not a lost peer, not under torch's collectives, or gradmesh's own: left as it was
    assert torch_collective_failure(RuntimeError("shape mismatch"), 0) is None
    mine = _module("/x/mine.py", f"def run():\n    raise RuntimeError({GLOO!r})\n")
    with pytest.raises(RuntimeError) as elsewhere:
        mine["run"]()
    assert torch_collective_failure(elsewhere.value, 0) is None
    assert torch_collective_failure(GradmeshError(GLOO), 0) is None


@pytest.mark.parametrize(
    ("call", "message"),
    [
        ("allreduce", "allreduce takes torch tensors, got int"),
        ("allgather", "allgather takes torch tensors, got list"),
        ("broadcast", "broadcast takes torch tensors, got list"),
        ("grouped_allreduce", "grouped_allreduce takes torch tensors, got int"),
        ("broadcast_", "broadcast takes torch tensors, got list"),
        ("allgather_async", "allgather takes torch tensors, got list"),
    ],
)
def test_a_horovod_call_given_no_tensor_is_one_line(call: str, message: str) -> None:
    """Once an AttributeError from deep inside ('list' object has no attribute 'detach');
    refused before the runtime is asked for, so no job is needed here."""
    from gradmesh.horovod import gathers, reductions

    fn = getattr(reductions, call, None) or getattr(gathers, call)
    args: tuple[Any, ...] = ([torch.ones(2), 3],) if call.endswith("allreduce") else ([1],)
    if call.startswith("broadcast"):
        args = ([1], 0)
    with pytest.raises(GradmeshError) as err:
        fn(*args)
    assert str(err.value) == message


def test_an_hf_shard_size_is_read_as_hugging_face_reads_it() -> None:
    """Checked before the model is made, by transformers' own parser: gradmesh's sizes once
    refused its 2GiB and let its refused 5G through to a traceback at the end."""
    pytest.importorskip("transformers")
    from gradmesh.train.export import _check_shard_size

    for good in ("5GB", "2GiB", "500MiB"):
        _check_shard_size(good)
    for bad in ("5G", "500", "lots"):
        with pytest.raises(GradmeshError, match=f"--max-shard-size '{bad}': expected a whole"):
            _check_shard_size(bad)
