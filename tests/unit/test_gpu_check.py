"""scripts/gpu_check.py, checked where no GPU is: its commands parse as gradmesh's, its table
reads the reports as they are written, and without CUDA it says so in one line."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from gradmesh.cli import build_parser
from tests.harness import SCRIPTS, kept_environment, script

SCRIPT = SCRIPTS / "gpu_check.py"


@pytest.fixture(scope="module")
def check() -> Iterator[ModuleType]:
    with script("gpu_check") as module:
        yield module


def test_every_row_is_a_command_gradmesh_parses(check: ModuleType) -> None:
    rows = check.rows()
    names = [r.name for r in rows]
    for wanted in ("gpt fp8", "gpt bf16 --compile", "trainer vs plain loop, bf16 compiled"):
        assert wanted in names
    for row in rows:
        if row.kind in ("pytest", "script"):
            # the test file, folder or script first; then its flags (an output's path)
            assert Path(SCRIPT.parents[1], row.args[0].split("::")[0]).exists(), row.args
            continue
        argv = check.gradmesh_command(row, Path("r.json"))[3:]  # after python -m gradmesh.cli
        build_parser(argv).parse_args(argv)  # an unknown flag exits here


def test_the_gpt_is_the_issues(check: ModuleType) -> None:
    assert round(check.parameters() / 1e6, 1) == 85.6


def test_the_memory_model_prices_each_gpt_row(
    check: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(check, "OUT", tmp_path)
    rows = {r.name: r for r in check.rows()}
    with kept_environment():  # the command line sets torch's log levels in its process
        plain = check.predicted_gib(rows["gpt bf16"])
        recomputed = check.predicted_gib(rows["gpt bf16 recompute blocks"])
    assert plain is not None and recomputed is not None and 0 < recomputed < plain


def test_the_table_reads_the_reports(check: ModuleType) -> None:
    train = check.Row("gpt bf16", [], precision="bf16")
    train.result = {"ok": True, "code": 0, "seconds": 21.0, "said": ""}
    train.result["predicted_gib"] = 2.5
    train.result["report"] = {
        "samples_per_s": 500.0,
        "steady_samples_per_s": 1000.0,
        "tokens_per_sample": 512,
        "mfu": 0.35,
        "gpu_peak_memory_bytes": 3 * 2**30,
    }
    bench = check.Row("trainer vs plain loop, bf16 eager", [], kind="bench")
    bench.result = {"ok": True, "code": 0, "seconds": 30.0, "said": "", "report": {"ratio": 1.02}}
    tests = check.Row("unit tests", [], kind="pytest")
    tests.result = {"ok": False, "code": 1, "seconds": 50.0, "said": "1 failed, 9 passed"}
    n = 85_600_000
    text = check.table([train, bench, tests], n, "an H100")
    formula = 512_000 * (6 * n + 12 * 12 * 768 * 512) / 989e12
    assert (
        f"| gpt bf16 | yes | 21 | 512,000 | 35.0% | {formula:.1%} | 3.0 GiB (model 2.5) |  |"
        in text
    )
    assert "| trainer vs plain loop, bf16 eager | yes | 30 |  |  |  |  | 1.020 |" in text
    assert "| unit tests | NO (1) | 50 |" in text and "1 failed, 9 passed" in text


def test_without_cuda_it_is_one_line(check: ModuleType, capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the check would run")
    assert check.main() == 2
    assert capsys.readouterr().err.strip() == "gpu_check: torch sees no CUDA device"


def test_the_profile_runs_only_when_the_compiled_trainer_misses_its_bar(check: ModuleType) -> None:
    """The profile row follows the compiled bench row and names it; it is needed when that row
    failed or its trainer kept less than 0.95x of the plain loop's rate (ms ratio over 1/0.95)."""
    rows = check.rows()
    names = [r.name for r in rows]
    profile = next(r for r in rows if r.unless_within)
    assert names.index(profile.name) == names.index(profile.unless_within) + 1
    bench = check.Row(profile.unless_within, [], kind="bench")
    bench.result = {"ok": False, "code": 124, "seconds": 240.0, "said": "over its limit"}
    assert not check.within_target(bench)
    for ratio, kept in ((1.05, True), (1.06, False), (0.98, True)):
        bench.result = {"ok": True, "code": 0, "seconds": 60.0, "report": {"ratio": ratio}}
        assert check.within_target(bench) is kept
