"""Checkpoints: atomic, newest wins, refuse another run's file, load with weights_only."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gradmesh.errors import GradmeshError
from gradmesh.train import checkpoint

IDENTITY = {"model": "cnn", "seed": 0}


def _model_and_opt(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(1, 4)).sum().backward()
    opt.step()  # creates momentum state
    return model, opt


def test_round_trip_restores_model_optimizer_and_history(tmp_path: Path) -> None:
    model, opt = _model_and_opt(0)
    checkpoint.save(str(tmp_path), 1, model, opt, IDENTITY, [0.5])
    checkpoint.save(str(tmp_path), 2, model, opt, IDENTITY, [0.5, 0.25])
    assert checkpoint.latest(str(tmp_path)) == tmp_path / "epoch-00002.pt"
    other, other_opt = _model_and_opt(1)
    epoch, losses = checkpoint.load(tmp_path / "epoch-00002.pt", other, other_opt, IDENTITY)
    assert (epoch, losses) == (2, [0.5, 0.25])
    assert torch.equal(other.weight, model.weight)
    saved = opt.state_dict()["state"][0]["momentum_buffer"]
    assert torch.equal(other_opt.state_dict()["state"][0]["momentum_buffer"], saved)
    assert not list(tmp_path.glob("*.tmp"))


def test_another_runs_checkpoint_is_refused(tmp_path: Path) -> None:
    model, opt = _model_and_opt(0)
    path = checkpoint.save(str(tmp_path), 1, model, opt, IDENTITY, [])
    with pytest.raises(GradmeshError, match="belongs to another run: model='cnn' \\(now 'mlp'\\)"):
        checkpoint.load(path, model, opt, {**IDENTITY, "model": "mlp"})


def test_pickled_objects_are_not_loaded(tmp_path: Path) -> None:
    path = tmp_path / "epoch-00001.pt"
    torch.save({"epoch": 1, "payload": Path("not allowed")}, path)
    model, opt = _model_and_opt(0)
    with pytest.raises(GradmeshError, match="cannot load checkpoint") as err:
        checkpoint.load(path, model, opt, IDENTITY)
    assert "\n" not in str(err.value)


def test_latest_of_missing_or_empty_directory(tmp_path: Path) -> None:
    assert checkpoint.latest(str(tmp_path / "none")) is None
    (tmp_path / "epoch-00003.pt.tmp").write_text("torn")
    assert checkpoint.latest(str(tmp_path)) is None
