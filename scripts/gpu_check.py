"""What a person with a GPU runs first: gradmesh's GPU paths, one row each, in one table.

    bash scripts/gpu_check.sh   # from the repository root; over 12 minutes on an H200

It uses the package from source (this checkout on PYTHONPATH) and the python on the PATH, which
must already hold torch (2.11 to 2.15, a CUDA build), numpy and pytest; nothing is downloaded.
gradmesh's own needs (scikit-learn, tqdm, msgpack) are checked first and named if missing. fp8
needs torchao: where it is not installed, a torchao wheel in ./.whl is installed into a temporary
folder (the machine may have no network); otherwise the fp8 row says so.

Each row is one command with its own time limit; the table gives, per row, whether it ran,
tokens/s, MFU (the report's, and the formula tokens/s x (6N + 12·L·d·s) / peak beside it),
the GPU's peak memory, and the plain PyTorch loop's ratio where the row compares with it. The
table and every report go to gpu_check/ (gpu_check/table.md, gpu_check/*.json).
`GPU_CHECK_FROM=NAME` starts at the first row whose name begins so (its table:
table_from_row_N.md): a second call goes on where a first one's time budget
(`GPU_CHECK_BUDGET_S`) stopped it. On an H200 (2026-11-30) the rows took 745 s in all, with
fp8's compile cut at 180 s; with its 360 s now, a whole run can pass 15 minutes.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
OUT = Path(os.environ.get("GPU_CHECK_OUT", ROOT / "gpu_check"))
GPT = {"dim": 768, "depth": 12, "heads": 12, "sequence": 512, "batch": 32}
"""The GPT issue 57 measured: 85.6M parameters (with the byte vocabulary's embeddings)."""
MODEL_ARGS = f"dim={GPT['dim']},depth={GPT['depth']},heads={GPT['heads']}"
GPT_FLAGS = [
    "--model", "gpt", "--dataset", "text", "--sequence-length", str(GPT["sequence"]),
    "--model-args", MODEL_ARGS,
    "--batch-size", str(GPT["batch"]), "--optimizer", "adamw", "--lr", "3e-4",
    "--epochs", "3", "--workers", "1",
]  # fmt: skip
LINTER_TEST = "tests/unit/test_architecture.py::test_imports_point_down_the_layers"
XDIST = ["-n", "8"] if importlib.util.find_spec("xdist") else []
"""The unit tests over 8 processes where pytest-xdist is there (a GPU host has the cores)."""
PEAKS = {"fp32": 66.9e12, "bf16": 989e12, "fp16": 989e12, "fp8": 1979e12}
"""H100 SXM dense peaks: the formula's column where a report names no peak (the report's MFU
reads the device table by the GPU's name, `gradmesh.models.devices`)."""


@dataclass
class Row:
    name: str
    args: list[str]
    kind: str = "train"
    """train (a report), bench (gradmesh bench overhead's JSON), pytest, or script (a file of
    scripts/ whose last line is the row's words)."""
    precision: str = "fp32"
    timeout_s: int = 120
    env: dict[str, str] = field(default_factory=dict)
    unless_within: str = ""
    """A bench row: this one is not run when that row's trainer kept issue 57's 0.95x of the
    plain loop's rate (a diagnosis needed only for a miss)."""
    result: dict[str, Any] = field(default_factory=dict)


def rows() -> list[Row]:
    gpt = ["train", *GPT_FLAGS]
    bench = ["bench", "overhead", "--device", "cuda", "--precision", "bf16", "--optimizer"]
    bench += ["adamw", "--model-args", MODEL_ARGS, "--sequence-length", str(GPT["sequence"])]
    bench += ["--batch", "32", "--rounds", "3", "--steps", "10"]
    return [  # the must-shows first: a run cut short by its device time keeps them
        Row("trainer vs plain loop, bf16 eager", bench, kind="bench", precision="bf16"),
        Row(
            "trainer vs plain loop, bf16 compiled",
            [*bench, "--compile"],
            kind="bench",
            precision="bf16",
            timeout_s=240,
        ),
        Row(  # what the trainer's compiled step adds to the plain loop's: the ops, in the log
            "profile of the compiled step",
            ["scripts/gpu_step.py", "--profile", "--compile"],
            kind="script",
            timeout_s=180,
            unless_within="trainer vs plain loop, bf16 compiled",
        ),
        Row("host syncs in the steady step", ["scripts/gpu_step.py"], kind="script"),
        Row("host syncs in the fp16 step", ["scripts/gpu_step.py", "--fp16"], kind="script"),
        Row("gpt bf16", [*gpt, "--precision", "bf16"], precision="bf16"),
        *(  # a world of one compiles the whole model: twice the blocks' compile time, cold;
            # fp8's graph took over 180 s to compile on an H200 (bf16's row: 75 s in all)
            Row(
                f"gpt {p} --compile",
                [*gpt, "--precision", p, "--compile"],
                precision=p,
                timeout_s=180 if p == "bf16" else 360,
            )
            for p in ("bf16", "fp8")
        ),
        Row("gpt fp8", [*gpt, "--precision", "fp8"], precision="fp8"),
        Row("default job (cnn on digits)", ["train", "--workers", "1"], timeout_s=90),
        *(Row(f"gpt {p}", [*gpt, "--precision", p], precision=p) for p in ("fp32", "fp16")),
        Row(
            "gpt bf16 --zero-stage 3",
            [*gpt, "--precision", "bf16", "--zero-stage", "3"],
            precision="bf16",
        ),
        Row(
            "gpt bf16 recompute blocks",
            [*gpt, "--precision", "bf16", "--activation-checkpointing", "blocks"],
            precision="bf16",
        ),
        Row(  # issue 60: one context-parallel rank's attention at torchtitan's 8B shapes; flat
            # on an H200 with the GPU empty (2026-11-30), so now as full as torchtitan's was
            "cp rank's attention, 8B at 32k tokens a rank, 11 GiB free",
            ["scripts/cp_probe.py", "--free-gib", "11", "--json", str(OUT / "cp_probe.json")],
            kind="script",
            timeout_s=120,
        ),
        Row("fp16 tests", ["tests/distributed/test_fp16.py"], kind="pytest", timeout_s=120),
        Row(  # import-linter is a development tool, not on a GPU image: CI runs that one
            "unit tests",
            ["tests/unit", "--deselect", f"{LINTER_TEST}", *XDIST],
            kind="pytest",
            timeout_s=300,
        ),
    ]


def gradmesh_command(row: Row, report: Path) -> list[str]:
    if row.kind == "pytest":
        return [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *row.args]
    if row.kind == "script":
        return [sys.executable, *row.args]
    return [sys.executable, "-m", "gradmesh.cli", *row.args, "--json", str(report)]


def stem(row: Row) -> str:
    return row.name.replace(" ", "_").replace("/", "_").replace(",", "")


TARGET = 0.95
"""issue 57's bar: the trainer's rate at least this fraction of the plain loop's."""


def within_target(row: Row) -> bool:
    """Whether a bench row ran and its trainer kept `TARGET` of the plain loop's rate."""
    ratio = row.result.get("report", {}).get("ratio")  # trainer ms / plain ms
    return ratio is not None and 1 / ratio >= TARGET


def run(row: Row, env: dict[str, str], deadline: float) -> None:
    """One row, its whole output kept in gpu_check/<row>.log; not started past the deadline
    (GPU_CHECK_BUDGET_S), so a check given little device time still writes its table."""
    report = OUT / f"{stem(row)}.json"
    report.unlink(missing_ok=True)
    started = time.monotonic()
    limit = min(row.timeout_s, int(deadline - started))
    if limit < 10:
        row.result = {"ok": False, "code": "skipped", "seconds": 0.0}
        row.result["said"] = "not run: the check's time budget (GPU_CHECK_BUDGET_S) was spent"
        return
    try:
        done = subprocess.run(
            gradmesh_command(row, report),
            cwd=ROOT,
            env={**env, **row.env},
            capture_output=True,
            text=True,
            timeout=limit,
        )
        code, out, err = done.returncode, done.stdout, done.stderr
        tail = (err or out).strip().splitlines()[-3:]
        if row.kind in ("pytest", "script"):
            tail = (out.strip() or err.strip()).splitlines()[-1:]
    except subprocess.TimeoutExpired as late:
        code, tail = 124, [f"over its {limit} s limit"]
        out, err = (
            x.decode() if isinstance(x, bytes) else x or "" for x in (late.stdout, late.stderr)
        )
    (OUT / f"{stem(row)}.log").write_text(
        f"$ {' '.join(gradmesh_command(row, report))}\n{out}\n{err}"
    )
    row.result = {"ok": code == 0, "code": code, "seconds": time.monotonic() - started}
    row.result["said"] = " | ".join(tail)[-300:]
    if code == 0 and report.exists():
        row.result["report"] = json.loads(report.read_text())


def parameters() -> int:
    """The GPT's parameters, counted on the meta device (the formula's N)."""
    import torch

    from gradmesh.models.registry import MODELS

    with torch.device("meta"):
        args = {k: GPT[k] for k in ("dim", "depth", "heads")}
        net = MODELS.get("gpt")((GPT["sequence"],), 256, **args)
    return sum(p.numel() for p in net.parameters())


def predicted_gib(row: Row) -> float | None:
    """The memory model's bytes a GPU for a GPT row (`gradmesh simulate` on the same model,
    batch, precision, ZeRO stage and recomputation; fp8 priced as bf16), in GiB."""
    from gradmesh.cli import main as gradmesh

    flags = ["--model", "gpt", "--model-args", MODEL_ARGS]
    flags += ["--sequence-length", str(GPT["sequence"]), "--vocab", "256", "--gpus", "1"]
    flags += ["--device", "h100", "--batch-per-gpu", str(GPT["batch"]), "--optimizer", "adamw"]
    flags += ["--dtype", "bf16" if row.precision == "fp8" else row.precision]
    for flag in ("--zero-stage", "--activation-checkpointing"):
        if flag in row.args:
            flags += [flag, row.args[row.args.index(flag) + 1]]
    out = OUT / f"{stem(row)}.simulated.json"
    with contextlib.redirect_stdout(io.StringIO()):
        if gradmesh(["simulate", *flags, "--json", str(out)]) != 0:
            return None
    memory = json.loads(out.read_text())["rows"][0]["memory"]["total_bytes"]
    return float(memory) / 2**30


def cells(row: Row, n: int) -> list[str]:
    """tokens/s, MFU (report), MFU (formula), GPU memory, vs plain loop."""
    r = row.result.get("report")
    if row.kind in ("pytest", "script") or not r:
        return ["", "", "", "", ""]
    if row.kind == "bench":
        ratio = r.get("ratio") or r.get("trainer_over_plain")
        return ["", "", "", "", f"{ratio:.3f}" if ratio is not None else "see JSON"]
    tokens = (r.get("steady_samples_per_s") or r["samples_per_s"]) * r.get("tokens_per_sample", 0)
    L, d, s = GPT["depth"], GPT["dim"], GPT["sequence"]
    peak = r.get("peak_flops") or PEAKS.get(row.precision, 0.0)  # the report's, as its MFU's
    formula = tokens * (6 * n + 12 * L * d * s) / peak if tokens and peak else 0.0
    memory, model = r.get("gpu_peak_memory_bytes"), row.result.get("predicted_gib")
    return [
        f"{tokens:,.0f}" if tokens else "",
        f"{r['mfu']:.1%}" if r.get("mfu") else "n/a",
        f"{formula:.1%}" if formula and row.name.startswith("gpt") else "",
        (f"{memory / 2**30:.1f} GiB" if memory else "")
        + (f" (model {model:.1f})" if model is not None else ""),
        "",
    ]


def table(all_rows: list[Row], n: int, header: str) -> str:
    lines = [
        header,
        "",
        "| row | ran | s | tokens/s | MFU (report) | MFU (formula) | GPU peak (memory model) "
        "| vs plain loop "
        "| last words |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in all_rows:
        ran = "yes" if row.result.get("ok") else f"NO ({row.result.get('code')})"
        words = (
            ""
            if row.result.get("ok") and row.kind not in ("pytest", "script")
            else row.result["said"]
        )
        lines.append(
            f"| {row.name} | {ran} | {row.result['seconds']:.0f} | "
            + " | ".join(cells(row, n))
            + f" | {words.replace('|', '/')} |"
        )
    return "\n".join(lines)


def missing_modules() -> list[str]:
    wanted = ("torch", "numpy", "pytest", "sklearn", "tqdm", "msgpack")
    return [m for m in wanted if importlib.util.find_spec(m) is None]


def main() -> int:
    sys.path.insert(0, str(ROOT))
    missing = missing_modules()
    if missing:
        print(f"gpu_check: this python lacks {', '.join(missing)}", file=sys.stderr)
        return 2
    import torch

    if not torch.cuda.is_available():
        print("gpu_check: torch sees no CUDA device", file=sys.stderr)
        return 2
    OUT.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    env["PYTHONUNBUFFERED"] = "1"
    all_rows, table_name = rows(), "table.md"
    if first := os.environ.get("GPU_CHECK_FROM"):  # a second call goes on where one stopped
        starts = [i for i, row in enumerate(all_rows) if row.name.startswith(first)]
        if not starts:
            print(f"gpu_check: GPU_CHECK_FROM={first!r} names no row", file=sys.stderr)
            return 2
        all_rows = all_rows[starts[0] :]
        table_name = f"table_from_row_{starts[0] + 1}.md"  # the first call's table.md stays
    deadline = time.monotonic() + float(os.environ.get("GPU_CHECK_BUDGET_S", "1e9"))
    header = (
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}, "
        f"{time.strftime('%Y-%m-%d')}, python {sys.version.split()[0]}"
    )
    n = parameters()
    by_name = {row.name: row for row in all_rows}
    for i, row in enumerate(all_rows):
        reference = by_name.get(row.unless_within)
        if reference is not None and within_target(reference):
            said = f"not needed: {row.unless_within} kept {TARGET}x of the plain loop's rate"
            row.result = {"ok": True, "code": 0, "seconds": 0.0, "said": said}
        else:
            run(row, env, deadline)
        print(f"gpu_check: {row.name}: {'ok' if row.result['ok'] else 'FAILED'} "
              f"({row.result['seconds']:.0f} s)", flush=True)  # fmt: skip
        if row.name.startswith("gpt") and row.result["ok"]:
            row.result["predicted_gib"] = predicted_gib(row)
        text = table(all_rows[: i + 1], n, header)  # after every row: a cut-short run keeps it
        (OUT / table_name).write_text(text + "\n")
    print(text)
    return 0 if all(r.result["ok"] for r in all_rows) else 1


if __name__ == "__main__":
    sys.exit(main())
