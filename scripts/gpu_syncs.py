"""The GPU check's host-sync row: steady steps of the trainer under torch's sync debug mode.

    python3 scripts/gpu_syncs.py [--precision bf16] [--workers-like dp]

Builds the trainer's job for the GPU check's GPT at a world of one (`gradmesh bench overhead`'s
trainer side), takes 5 warm-up steps, then 5 steps with `torch.cuda.set_sync_debug_mode("warn")`,
and prints how many calls made the host wait for the GPU and, for each distinct one, the
innermost gradmesh frame. Exit status 1 when there was any. The CPU suite's version of the same
rule is `gradmesh.runtime.host_reads` (tests/distributed/test_host_reads.py).
"""

from __future__ import annotations

import sys
import traceback
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    sys.path.insert(0, str(ROOT))
    import torch

    from gradmesh.bench.overhead import Config, _backend, trainer_side
    from gradmesh.runtime.world import init, shutdown

    if not torch.cuda.is_available():
        print("gpu_syncs: torch sees no CUDA device", file=sys.stderr)
        return 2
    args = Config(
        device="cuda", precision="bf16", optimizer="adamw", batch=32, sequence_length=512,
        model_args="dim=768,depth=12,heads=12",
    )  # fmt: skip
    rt = init(backend=_backend("cuda"))
    seen: dict[str, int] = {}
    try:
        side, _ = trainer_side(args, rt)
        for _ in range(5):
            side.step()
        torch.cuda.synchronize()

        def record(message, category, filename, lineno, file=None, line=None):  # type: ignore[no-untyped-def]
            ours = [f for f in traceback.extract_stack() if "/gradmesh/" in f.filename]
            where = (
                f"{ours[-1].filename.split('/gradmesh/')[-1]}:{ours[-1].lineno}" if ours else "?"
            )
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
        shutdown()
    total = sum(seen.values())
    print(
        f"host syncs in 5 steady steps: {total}" + "".join(f"; {k} x{n}" for k, n in seen.items())
    )
    return 1 if total else 0


if __name__ == "__main__":
    sys.exit(main())
