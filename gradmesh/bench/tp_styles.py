"""`gradmesh bench tp-styles`: gradmesh's tensor-parallel layers against torch's DTensor styles
on the same model, the figure `gradmesh.layout.tensor.layers`'s docstring gives for keeping
its own operators.

The built-in GPT's MLPs are split over `--world` tensor-parallel ranks both ways: by gradmesh's
plan (`blocks.*.mlp.fc1: colwise`, `fc2: rowwise`) and by `parallelize_module` with
`ColwiseParallel` / `RowwiseParallel` on the mesh's `DeviceMesh` (the rest of the model stays
whole in both, so the two compute the same thing). Each job takes `--warmup` steps, then
`--steps` timed steps of forward, backward and AdamW on a fixed batch; the jobs alternate
over `--rounds`; the figure is the median step per implementation and their ratio.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gradmesh.bench.harness import compare_jobs, limit_of, median, report
from gradmesh.launch.jobs import worker_main
from gradmesh.options import option
from gradmesh.runtime.axes import TP

IMPLEMENTATIONS = ("gradmesh", "dtensor")


@dataclass
class Config:
    """gradmesh bench tp-styles: gradmesh's tensor-parallel layers against DTensor's styles"""

    world: int = option(2, "tensor-parallel ranks", at_least=1)
    dim: int = option(128, "the GPT's width", at_least=1)
    depth: int = option(2, "the GPT's blocks", at_least=1)
    batch: int = option(8, "sequences per step", at_least=1)
    sequence_length: int = option(64, "tokens per sequence", at_least=1)
    steps: int = option(20, "timed steps per job", at_least=1)
    warmup: int = option(3, "untimed steps first", at_least=0)
    rounds: int = option(3, "interleaved rounds", at_least=1)
    json: str | None = option(None, "write the result here")


def measure(config: dict[str, Any]) -> tuple[int, Any]:
    """One implementation's job on one rank: the seconds of each timed step (the slowest
    rank's) and the machine's idle CPU share."""
    import torch
    import torch.nn.functional as F

    from gradmesh.bench.harness import timed_turn
    from gradmesh.layout.tensor.plan import apply_tp_plan
    from gradmesh.models.gpt import GPT, GPTConfig
    from gradmesh.runtime.world import init, shutdown

    rt = init(tensor_parallel=config["world"])
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab=256, seq=config["seq"], dim=config["dim"], depth=config["depth"]))
    mlps = {f"blocks.{i}.mlp.fc1": "colwise" for i in range(config["depth"])}
    mlps.update({f"blocks.{i}.mlp.fc2": "rowwise" for i in range(config["depth"])})
    if config["impl"] == "gradmesh":
        apply_tp_plan(model, mlps, rt.size, rt.rank, "gpt")
    else:
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        styles = {
            k: ColwiseParallel() if v == "colwise" else RowwiseParallel() for k, v in mlps.items()
        }
        parallelize_module(model, rt.mesh.device_mesh()[TP], styles)  # type: ignore[arg-type]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    data = torch.randint(0, 256, (config["batch"], config["seq"] + 1), generator=g, device="cpu")

    def one_step() -> None:
        out = model(data[:, :-1])
        loss = F.cross_entropy(out.flatten(0, 1), data[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()

    for _ in range(config["warmup"]):
        one_step()
    turns = [timed_turn(one_step) for _ in range(config["steps"])]
    idle = sum(t.idle for t in turns) / max(sum(t.total for t in turns), 1)
    shutdown()
    return rt.rank, {"step_s": median([t.seconds for t in turns]), "cpu_idle": idle}


def run(args: Config, _command: list[str] | None = None) -> int:
    from gradmesh.errors import GradmeshError

    if args.world < 2 or args.steps < 1 or args.rounds < 1 or args.dim % args.world:
        raise GradmeshError("need --world >= 2 dividing --dim, --steps >= 1, --rounds >= 1")
    common = {
        "world": args.world,
        "dim": args.dim,
        "depth": args.depth,
        "batch": args.batch,
        "seq": args.sequence_length,
        "steps": args.steps,
        "warmup": args.warmup,
    }
    configs = [{"impl": impl, **common} for impl in IMPLEMENTATIONS]
    runs = compare_jobs("gradmesh.bench.tp_styles", args.world, configs, args.rounds)
    results: dict[str, dict[str, Any]] = {}
    for impl, jobs in zip(IMPLEMENTATIONS, runs, strict=True):
        step = median([job["step_s"] for job in jobs])
        idle = median([job["cpu_idle"] for job in jobs])
        results[impl] = {"step_s": step, "cpu_idle": idle, "limit": limit_of(idle, None)}
    ratio = results["dtensor"]["step_s"] / results["gradmesh"]["step_s"]
    payload = {**common, "rounds": args.rounds, "results": results, "dtensor_over_gradmesh": ratio}
    lines = [
        f"{impl:8} step {r['step_s'] * 1e3:7.2f} ms  cpu idle {r['cpu_idle']:.2f} ({r['limit']})"
        for impl, r in results.items()
    ]
    lines.append(f"DTensor / gradmesh step time: {ratio:.2f} (GPT dim {args.dim}, MLPs split)")
    return report(args.json, payload, lines)


if __name__ == "__main__":
    worker_main(measure)
