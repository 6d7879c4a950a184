"""Real steps of a layout, for the mesh planner's calibration and for `gradmesh bench layout`:
one job of the trainer's own setup (split, optimizer, strategy) per layout, steps on one fixed
global batch, and the trainer's layout figures. `python -m gradmesh.plan.calibrate` is the
job's worker."""

from __future__ import annotations

from typing import Any

from gradmesh.layout.config import Layout


def layout_job(
    options: dict[str, Any],
    world: int,
    lay: Layout,
    steps: int,
    warmup: int,
    memory: bool = False,
) -> dict[str, Any]:
    """The config of a job timing `lay` on `world` ranks; `options` are the workload's
    `gradmesh train` options (`TrainWorkload`: model, data, batch; any other `gradmesh train`
    option), and the layout's own (`Layout.options`: its sizes, micro-batches, schedule, ZeRO
    stage and recomputation). With `memory`, the job also reports what each rank
    holds (`memory_figures`)."""
    return {
        "memory": memory,
        "options": {**options, **lay.options()},
        "world": world,
        "steps": steps,
        "warmup": warmup,
    }


def measure(config: dict[str, Any]) -> tuple[int, Any]:
    """One layout's job, on one rank (`layout_job`'s config): rank 0's figures."""
    from gradmesh.runtime.world import init, shutdown
    from gradmesh.train.config import TrainConfig
    from gradmesh.train.finish import layout_figures
    from gradmesh.train.rank_stats import KINDS, gather_rank_stats, summarize_layout
    from gradmesh.train.setup import attach, setup
    from gradmesh.train.timing import timed_steps

    train = TrainConfig.of(**config["options"], workers=config["world"])
    pp = train.layout.pipeline_parallel
    batch = train.data.batch_size
    rt = init(mesh=train.layout.mesh_sizes())
    job = setup(train, rt)
    attach(job)
    step_s, cpu_idle, _ = timed_steps(job, batch, config["warmup"], config["steps"])
    stats = gather_rank_stats(rt, 0.0, layout_figures(job, config["steps"]))
    mean = summarize_layout(stats.layout)
    result = {
        "step_s": step_s,
        "bytes_per_step": {k: mean[f"{k}_bytes_per_step"] for k in KINDS if k != "metrics"},
        "param_bytes_per_rank": mean["param_bytes"],
        "bubble": mean["bubble"] if pp > 1 else None,
        "stage_idle": stats.layout["stage_idle"] if pp > 1 else None,
        "cpu_idle": cpu_idle,
    }
    if config["memory"]:
        result |= memory_figures(job, batch)
    shutdown()
    return rt.rank, result


def memory_figures(job: Any, batch: int) -> dict[str, int]:
    """This rank's parameter, gradient and optimizer-state bytes at rest (shards as held), the
    peak of live tensor bytes one more step adds, and the whole model's parameter bytes."""
    from gradmesh.layout.memory import peak_bytes
    from gradmesh.sync.sharded.model import state_bytes
    from gradmesh.train.setup import model_of
    from gradmesh.train.timing import replica_step

    held = state_bytes(job.split.module, job.optimizer)
    whole = model_of(job.config, job.data).parameters()
    return {
        **held,
        "peak_bytes": peak_bytes(replica_step(job, batch)),
        "model_param_bytes": sum(p.numel() * p.element_size() for p in whole),
    }


def calibrator(
    options: dict[str, Any], world: int, cluster: Any = None, steps: int = 6, warmup: int = 2
) -> Any:
    """A `measure` for `plan_mesh`: each calibration layout timed in a job of its own on the
    job's ranks (of `cluster`, or loopback); its median step seconds."""
    from gradmesh.launch.jobs import run_workers

    def run(layouts: list[Layout]) -> dict[Layout, float]:
        return {
            lay: run_workers(
                "gradmesh.plan.calibrate",
                world,
                layout_job(options, world, lay, steps, warmup),
                300.0,
                cluster,
            )["step_s"]
            for lay in layouts
        }

    return run


if __name__ == "__main__":
    from gradmesh.launch.jobs import worker_main

    worker_main(measure)
