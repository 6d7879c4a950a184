"""The GPU check's look inside the step, for the GPU check's GPT at a world of one:

    python3 scripts/gpu_step.py [--fp16]             # host syncs in the trainer's steady step
    python3 scripts/gpu_step.py --profile [--compile] # the trainer's and the plain loop's ops

Both build `gradmesh bench overhead`'s two sides (the trainer's job, a plain loop) and take 5
warm-up steps. Without `--profile`: 5 steps of the trainer (bf16; `--fp16`: fp16 with its loss
scale) with `torch.cuda.set_sync_debug_mode("warn")`, printing how many calls made the host wait
for the GPU and, for each distinct one, the innermost gradmesh frame; exit status 1 when there
was any (the CPU suite's version of the same rule is `gradmesh.runtime.host_reads`). With
`--profile`: each side's ms a step, the GPU's busy time a step (its kernels' own time summed:
well under the step's time means the step waits on its host), dynamo's counters (graphs, graph
breaks, recompiles) and torch.profiler's top operations by host time and by GPU time over 3
steps, to find what the trainer adds.
"""

from __future__ import annotations

import sys
import threading
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    sys.path.insert(0, str(ROOT))
    import torch

    from gradmesh.bench.overhead import Config, _backend, plain_side, trainer_side
    from gradmesh.runtime.world import init, shutdown

    if not torch.cuda.is_available():
        print("gpu_step: torch sees no CUDA device", file=sys.stderr)
        return 2
    args = Config(
        device="cuda", precision="fp16" if "--fp16" in sys.argv else "bf16", optimizer="adamw",
        batch=32, sequence_length=512, model_args="dim=768,depth=12,heads=12",
        compile="--compile" in sys.argv,
    )  # fmt: skip
    rt = init(backend=_backend("cuda"))
    seen: dict[str, int] = {}
    side = None
    try:
        side, (job, indices) = trainer_side(args, rt)
        if "--profile" in sys.argv:
            profile({"trainer": side, "plain": plain_side(args, job, indices)})
            return 0
        for _ in range(5):
            side.step()
        torch.cuda.synchronize()

        def record(message, category, filename, lineno, file=None, line=None):  # type: ignore[no-untyped-def]
            stack = [f for f in traceback.extract_stack() if "warnings.py" not in f.filename][:-1]
            ours = [f for f in stack if "/gradmesh/" in f.filename]
            where = f"{ours[-1].filename.split('/gradmesh/')[-1]}:{ours[-1].lineno}" if ours else ""
            if not where:  # none of gradmesh's frames: the thread and the innermost three
                inner = [f"{f.filename.rsplit('/', 2)[-1]}:{f.lineno}" for f in stack[-3:]]
                where = f"thread {threading.current_thread().name}: {' < '.join(inner[::-1])}"
            seen[where] = seen.get(where, 0) + 1

        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = record
            torch.cuda.set_sync_debug_mode("warn")
            try:
                for _ in range(5):
                    side.step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
    finally:
        if side is not None:
            side.close()  # the trainer's reader thread
        shutdown()
    total = sum(seen.values())
    print(
        f"host syncs in 5 steady steps: {total}" + "".join(f"; {k} x{n}" for k, n in seen.items())
    )
    return 1 if total else 0


def profile(sides: dict[str, Any]) -> None:
    import torch
    from torch._dynamo.utils import counters
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as profiled

    for name, side in sides.items():
        counters.clear()  # this side's compile alone
        for _ in range(5):
            side.step()
        torch.cuda.synchronize()
        stats = {k: dict(v) for k, v in counters.items() if k in ("stats", "graph_break")}
        print(f"{name}: dynamo's counters after its warm-up: {stats}")  # graphs, breaks, recompiles
        started = time.perf_counter()
        for _ in range(10):
            side.step()
        torch.cuda.synchronize()
        print(f"{name}: {(time.perf_counter() - started) * 100:.2f} ms a step (10 steps)")
        with profiled(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                side.step()
            torch.cuda.synchronize()
        table = prof.key_averages()
        kernels = [  # as the table's own total counts them
            e for e in table if e.device_type == DeviceType.CUDA and not e.is_user_annotation
        ]
        busy = sum(e.self_device_time_total for e in kernels) / 3e3  # us in 3 steps: ms a step
        print(f"{name}: the GPU busy {busy:.2f} ms a step (kernels' own time, summed)")
        for key in ("cpu_time_total", "self_device_time_total"):
            print(f"== {name}, 3 steps, by {key}")
            print(table.table(sort_by=key, row_limit=15, max_name_column_width=50))


if __name__ == "__main__":
    sys.exit(main())
