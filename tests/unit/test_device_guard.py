"""The device guard (gradmesh/runtime/device_guard.py) and the torch range (runtime/compat.py).

Every test of the suite runs under the guard (tests/conftest.py turns it on here and in every
process a test starts); these check that the guard itself would fail the bug it exists for."""

from __future__ import annotations

import ast
import inspect
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import gradmesh
import gradmesh.layout.engine as engine
from gradmesh.errors import GradmeshError
from gradmesh.runtime import compat, device_guard

PACKAGE = Path(gradmesh.__file__).parent
FACTORIES = {
    "zeros", "ones", "empty", "full", "tensor", "arange", "randn", "rand", "randint",
    "randperm", "eye", "linspace", "logspace", "as_tensor", "scalar_tensor", "empty_strided",
}  # fmt: skip


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(6, 4), torch.randint(0, 3, (6,))


def test_the_suite_runs_under_the_guard() -> None:
    assert device_guard.enabled() and device_guard.active()


def test_the_engine_step_of_b000888_fails_under_the_guard() -> None:
    """The plain engine's step with its loss total made as b000888 made it (no device=) is
    refused, naming the file and line; the step as it is now runs."""
    source = textwrap.dedent(inspect.getsource(engine.PlainEngine.step))
    assert "device=self.device" in source
    broken = source.replace(", device=self.device", "")
    first = engine.PlainEngine.step.__code__.co_firstlineno
    code = compile("\n" * (first - 1) + broken, engine.__file__, "exec")
    scope: dict[str, Any] = {}
    exec(code, vars(engine), scope)
    x, y = _batch()
    good = engine.PlainEngine(_model())
    assert torch.isfinite(good.step(x, y, 1.0))
    bad = engine.PlainEngine(_model())
    bad.step = scope["step"].__get__(bad)  # type: ignore[method-assign]
    with pytest.raises(GradmeshError, match=r"layout/engine\.py:\d+: torch\.zeros without device="):
        bad.step(x, y, 1.0)


def test_torch_internals_and_named_devices_pass() -> None:
    """What torch makes for itself (an optimizer's step counter) and what names its device are
    not the guard's business; code outside gradmesh neither."""
    model = _model()
    opt = torch.optim.Adam(model.parameters())
    x, y = _batch()
    engine.PlainEngine(model).step(x, y, 1.0)
    opt.step()
    assert torch.zeros(2).shape == (2,)  # a test's (a user's) own tensor


def test_every_factory_in_the_package_names_its_device() -> None:
    """The static side of the same rule, for code paths no test reaches: every torch factory
    call in gradmesh names a device (or copies one: `*_like`, `new_*`)."""
    missing = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in FACTORIES
                and isinstance(node.func.value, ast.Name)
                and node.func.value.id == "torch"
                and not any(k.arg == "device" for k in node.keywords)
            ):
                missing.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    assert missing == []


@pytest.mark.parametrize(
    ("version", "release"),
    [("2.11.0+cu128", (2, 11)), ("2.15.0.dev20260101", (2, 15)), ("2.13.0", (2, 13))],
)
def test_torch_releases_parse(version: str, release: tuple[int, int]) -> None:
    assert compat.release(version) == release


def test_the_torch_range_is_one_line_each_side() -> None:
    assert compat.check_torch("2.11.0+cu126") is None
    assert compat.check_torch("2.15.1") is None
    with pytest.raises(GradmeshError, match=r"needs torch 2\.11 to 2\.15; .* torch 2\.10\.1"):
        compat.check_torch("2.10.1")
    newer = compat.check_torch("2.16.0")
    assert newer is not None and "newer than the tested range" in newer


def test_torch_without_the_single_collectives_uses_the_older_names(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """torch 2.11 and 2.12 have all_gather_into_tensor / reduce_scatter_tensor only."""
    calls: list[str] = []
    monkeypatch.delattr(dist, "all_gather_single", raising=False)
    monkeypatch.delattr(dist, "reduce_scatter_single", raising=False)
    monkeypatch.setattr(dist, "all_gather_into_tensor", lambda *a, **k: calls.append("gather"))
    monkeypatch.setattr(dist, "reduce_scatter_tensor", lambda *a, **k: calls.append("scatter"))
    out, mine = torch.zeros(2), torch.zeros(1)
    compat.all_gather_single(out, mine, None, True)
    compat.reduce_scatter_single(mine, out, None, None, False)
    assert calls == ["gather", "scatter"]


def test_an_old_torch_is_one_line_at_import(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The command line exits 2 with the line; a script's `import gradmesh` raises it."""
    monkeypatch.setattr(compat.metadata, "version", lambda name: "2.10.0")
    monkeypatch.setattr(sys, "argv", ["/venv/bin/gradmesh", "train"])
    with pytest.raises(SystemExit) as exited:
        compat.check_at_import()
    assert exited.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err == "gradmesh: error: gradmesh needs torch 2.11 to 2.15; this python has torch " \
        "2.10.0: install one in the range"  # fmt: skip
    monkeypatch.setattr(sys, "argv", ["train.py"])
    with pytest.raises(ImportError, match=r"needs torch 2\.11 to 2\.15"):
        compat.check_at_import()
    monkeypatch.setattr(compat.metadata, "version", lambda name: "2.16.0")
    compat.check_at_import()
    assert "newer than the tested range" in capsys.readouterr().err
