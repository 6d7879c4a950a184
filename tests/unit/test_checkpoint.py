"""Step checkpoints: metadata last, newest complete wins, the newest K kept, torn and foreign
ones never chosen, every malformed file one line naming it, nothing pickled ever run."""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch

from gradmesh.errors import GradmeshError
from gradmesh.train import checkpoint

IDENTITY = {"model": "linear", "seed": 0}


def _model_and_opt(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(1, 4)).sum().backward()
    opt.step()  # creates momentum state
    return model, opt


def _state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    return {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "strategy": {"steps": 3},
        "rng": checkpoint.rng_state(),
        "progress": {"loss_sum": torch.tensor([1.5, 3.0], dtype=torch.float64)},
    }


def save(
    folder: Path, step: int, world: int = 1, keep: int = 3, asynchronous: bool = False
) -> Path:
    """A complete checkpoint of `world` ranks (each rank's writer in turn, rank 0 last)."""
    model, opt = _model_and_opt(step)
    for rank in reversed(range(world)):
        writer = checkpoint.Checkpointer(str(folder), rank, world, IDENTITY, keep, asynchronous, 5)
        writer.save(
            step, step // 10, step % 10, [0.5] * (step // 10), 64 * step, _state(model, opt)
        )
        writer.close()
    return checkpoint.folder(folder, step)


def choose(folder: Path, warnings: list[str] | None = None) -> checkpoint.Meta | None:
    model, _ = _model_and_opt(0)

    def usable(meta: checkpoint.Meta) -> None:
        for rank in range(meta.world):
            checkpoint.read_rank(meta.checkpoint, rank, model)

    found = checkpoint.choose(folder, IDENTITY, usable)
    return found[0] if found else None


@pytest.mark.parametrize("asynchronous", [False, True])
def test_round_trip_keeps_the_newest_k_and_restores_every_piece(
    tmp_path: Path, asynchronous: bool
) -> None:
    for step in (10, 20, 25, 30):
        save(tmp_path, step, world=2, keep=2, asynchronous=asynchronous)
    assert [p.name for p in checkpoint.complete(tmp_path)] == ["step-00000030", "step-00000025"]
    meta = checkpoint.read_meta(checkpoint.folder(tmp_path, 30))
    assert (meta.step, meta.epoch, meta.offset, meta.world, meta.losses) == (30, 3, 0, 2, [0.5] * 3)
    state = checkpoint.read_rank(meta.checkpoint, 1)
    model, opt = _model_and_opt(30)
    assert torch.equal(state["model"]["weight"], model.weight)
    saved = state["optimizer"]["state"][0]["momentum_buffer"]
    assert torch.equal(saved, opt.state_dict()["state"][0]["momentum_buffer"])
    assert state["strategy"] == {"steps": 3}
    assert not list(tmp_path.rglob("*.tmp"))


def test_a_folder_without_metadata_is_never_chosen_and_is_pruned_once_older(
    tmp_path: Path,
) -> None:
    save(tmp_path, 10)
    torn = checkpoint.folder(tmp_path, 20)
    torn.mkdir()
    (torn / "rank-00000.pt").write_bytes(b"half a file")
    assert choose(tmp_path).step == 10  # type: ignore[union-attr]
    save(tmp_path, 30)
    assert not torn.exists()


def test_the_newest_broken_checkpoint_falls_back_with_a_warning(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    save(tmp_path, 10)
    newest = save(tmp_path, 20)
    data = (newest / "rank-00000.pt").read_bytes()
    (newest / "rank-00000.pt").write_bytes(data[: len(data) // 2])  # truncated
    assert choose(tmp_path).step == 10  # type: ignore[union-attr]
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"gradmesh: warning: cannot load checkpoint {newest}/rank-00000.pt: ")
    assert err.endswith("falling back to step-00000010") and "\n" not in err


def _crafted(tmp_path: Path, kind: str) -> Path:
    """A checkpoint whose rank file is malformed in one way."""
    ck = save(tmp_path, 10)
    path = ck / "rank-00000.pt"
    state = torch.load(path, weights_only=True)
    if kind == "list":
        state = [1, 2, 3]
    elif kind == "missing":
        del state["optimizer"]
    elif kind == "types":
        state["strategy"] = [1]
    elif kind == "shape":
        state["model"]["weight"] = torch.zeros(3, 3)
    elif kind == "pickle":

        class Payload:
            def __reduce__(self) -> tuple[Any, ...]:
                return (os.system, ("touch " + str(tmp_path / "ran"),))

        path.write_bytes(pickle.dumps({"model": Payload()}))
        return path
    torch.save(state, path)
    return path


@pytest.mark.parametrize(
    ("kind", "problem"),
    [
        ("list", "does not fit this run: expected a mapping of checkpoint fields, found list"),
        ("missing", "does not fit this run: no 'optimizer' entry"),
        ("types", "does not fit this run: 'strategy' is a list, not a mapping"),
        ("shape", "model entry 'weight' is [3, 3] torch.float32, the model needs [2, 4]"),
        ("pickle", "cannot load checkpoint"),
    ],
)
def test_a_malformed_rank_file_is_one_line_naming_it(
    tmp_path: Path, kind: str, problem: str
) -> None:
    path = _crafted(tmp_path, kind)
    with pytest.raises(GradmeshError) as err:
        choose(tmp_path)
    message = str(err.value)
    assert str(path) in message and problem in message and "\n" not in message
    assert message.endswith("no earlier complete checkpoint to fall back to")
    assert not (tmp_path / "ran").exists()  # the pickled payload never ran


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        (lambda m: "not json", "cannot read checkpoint metadata"),
        (lambda m: [m], "expected a mapping, found list"),
        (lambda m: {k: v for k, v in m.items() if k != "step"}, "no 'step' entry"),
        (lambda m: {**m, "step": "ten"}, "'step' is a str, not an integer"),
        (lambda m: {**m, "format": 1}, "format 1, this gradmesh reads format 2"),
        (lambda m: {**m, "files": ["rank-00000.pt", "x"]}, "one file per rank of 1"),
        (lambda m: {**m, "epoch_loss": [1.0]}, "'epoch_loss' must be two numbers"),
        (lambda m: {**m, "membership": [[0, "4"]]}, "list of [step, workers] pairs"),
    ],
)
def test_malformed_metadata_is_one_line_naming_it(
    tmp_path: Path, change: Any, problem: str
) -> None:
    ck = save(tmp_path, 10)
    meta = json.loads((ck / "meta.json").read_text())
    changed = change(meta)
    (ck / "meta.json").write_text(changed if isinstance(changed, str) else json.dumps(changed))
    with pytest.raises(GradmeshError) as err:
        choose(tmp_path)
    assert str(ck / "meta.json") in str(err.value) and problem in str(err.value)


def test_an_elastic_jobs_entries_are_read_back(tmp_path: Path) -> None:
    writer = checkpoint.Checkpointer(str(tmp_path), 0, 1, IDENTITY, 3, False, 5)
    model, opt = _model_and_opt(0)
    extra = {"epoch_loss": [12.5, 40.0], "membership": [[0, 4], [40, 3]]}
    writer.save(40, 1, 17, [0.5], 2560, _state(model, opt), extra)
    writer.close()
    meta = choose(tmp_path)
    assert meta is not None
    assert (meta.epoch_loss, meta.membership) == ([12.5, 40.0], [[0, 4], [40, 3]])


def test_another_runs_checkpoint_is_refused_not_fallen_back_from(tmp_path: Path) -> None:
    save(tmp_path, 10)
    with pytest.raises(
        GradmeshError, match="belongs to another run: model='linear' \\(now 'mlp'\\)"
    ):
        checkpoint.choose(tmp_path, {**IDENTITY, "model": "mlp"}, lambda meta: None)


def test_old_format_and_empty_folders(tmp_path: Path) -> None:
    assert checkpoint.choose(tmp_path / "none", IDENTITY, lambda meta: None) is None
    assert choose(tmp_path) is None
    (tmp_path / "epoch-00003.pt").write_text("old")
    with pytest.raises(GradmeshError, match="holds checkpoints of an older gradmesh"):
        choose(tmp_path)


def test_a_rank_that_never_writes_its_part_is_named(tmp_path: Path) -> None:
    model, opt = _model_and_opt(0)
    writer = checkpoint.Checkpointer(str(tmp_path), 0, 3, IDENTITY, 3, False, 0.2)
    with pytest.raises(GradmeshError, match="rank\\(s\\) 1, 2 did not write their part within"):
        writer.save(5, 0, 5, [], 0, _state(model, opt))
    assert checkpoint.complete(tmp_path) == []


def test_steps_redone_are_counted_from_the_furthest_step(tmp_path: Path) -> None:
    progress = checkpoint.Progress(str(tmp_path))
    assert progress.resumed_at(0) == 0
    for step in range(1, 14):
        progress.reached(step)
    progress.close()
    again = checkpoint.Progress(str(tmp_path))
    assert again.resumed_at(10) == 3
    again.reached(12)
    again.close()
    assert checkpoint.Progress(str(tmp_path)).resumed_at(12) == 3
