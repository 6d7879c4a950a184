"""After the loop: the final model brought here, evaluated, and the run report built (with the
layout's figures and what checkpoints and restarts cost)."""

from __future__ import annotations

import torch

from gradmesh.observe.metrics import Metrics
from gradmesh.runtime.process import restarts
from gradmesh.train.evaluation import evaluate
from gradmesh.train.loop import Clock
from gradmesh.train.rank_stats import KINDS, gather_rank_stats
from gradmesh.train.report import RunFacts, RunReport
from gradmesh.train.setup import Job


def _run_scalars(job: Job, report: RunReport, steps: int) -> None:
    """What is known at the end: the world's mean loss per epoch, the test accuracy, a ps job's
    staleness histogram and request rates, Hogwild!'s updates, restarts."""
    metrics = job.metrics or Metrics(job.config.output.tensorboard or "", f".report{job.place[0]}")
    per_epoch = job.sharder.steps_per_epoch() if job.sharder is not None else 1
    for epoch, loss in enumerate(report.loss_history):
        metrics.scalars((epoch + 1) * per_epoch, {"loss/epoch_mean": loss})
    info = report.strategy_info
    values = {"job/restarts": float(restarts())}
    if report.test_accuracy is not None:
        values["accuracy/test_final"] = report.test_accuracy
    if "updates_applied" in info:
        values["hogwild/updates_applied"] = float(info["updates_applied"])
    for server in info.get("server_stats", []):
        values[f"ps/request_rate_server{server['server']}"] = server["request_rate"]
    metrics.scalars(steps, values)
    merged: dict[int, int] = {}
    for counts in info.get("staleness_histogram", {}).values():
        for gap, n in counts.items():
            merged[int(gap)] = merged.get(int(gap), 0) + int(n)
    metrics.histogram("ps/staleness", merged, steps)
    metrics.close()


def layout_figures(job: Job, steps: int) -> dict[str, float]:
    """What this rank holds, what it sent per step by kind over `steps` steps, and as a pipeline
    stage its compute seconds per step and idle fraction: the report's figures, and
    `gradmesh bench layout`'s (`summarize_layout` makes them one)."""
    rt, split = job.rt, job.split
    state = [
        v
        for entry in job.optimizer.state.values()
        for v in entry.values()
        if isinstance(v, torch.Tensor)
    ]
    steps = max(steps, 1)
    engine_clock = getattr(split.engine, "clock", None)
    return {
        "param_bytes": sum(p.numel() * p.element_size() for p in split.module.parameters()),
        "optimizer_bytes": sum(v.numel() * v.element_size() for v in state),
        **{f"{kind}_bytes_per_step": rt.comm.by_kind.get(kind, 0) / steps for kind in KINDS},
        "compression_given_bytes_per_step": rt.comm.compressed.get("sync", [0, 0])[0] / steps,
        "compression_sent_bytes_per_step": rt.comm.compressed.get("sync", [0, 0])[1] / steps,
        "stage_busy_s": engine_clock.busy_s / steps if engine_clock is not None else 0.0,
        "stage_idle": engine_clock.idle() if engine_clock is not None else 0.0,
        "peak_flops": job.model_flops[1],
        "gpu_peak_memory_bytes": gpu_peak_memory(rt.device),
    }


def gpu_peak_memory(device: torch.device) -> float:
    """The most bytes of tensors this process held on its GPU in the run
    (`torch.cuda.max_memory_allocated`); 0 off CUDA, where nothing CUDA is called."""
    return float(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else 0.0


def finish(job: Job, clock: Clock, samples: int, wall_s: float) -> tuple[RunReport, bool]:
    """Bring the final model here (asynchronous strategies), evaluate, build the report."""
    job.strategy.finish(samples, wall_s)
    score = evaluate(job.split, job.data.test, job.rt)
    stats = gather_rank_stats(job.rt, clock.compute_s, layout_figures(job, clock.steps))
    facts = RunFacts(  # worker processes (replicas for ps, one per worker)
        job.replicas * job.rt.size // job.rt.batch.size,
        {**job.strategy.report(), **job.replica_info},
        score.accuracy if score is not None else None,
        clock.losses,
        wall_s,
        clock.samples,
        stats,
        job.split.info,
        _faults(job),
        clock.steps,
        clock.cpu_idle,
        job.model_flops[0],
        job.peak_source,
        clock.steady_samples / clock.steady_s if clock.steady_s > 0 else 0.0,
        test_loss=score.loss if score is not None else None,
        evals=clock.evals,
    )
    report = RunReport.build(job.config, facts)
    if job.evaluator is not None:
        job.evaluator.close()
    writes = job.strategy.writes_report(job.rt)
    if job.config.output.tensorboard and writes:
        _run_scalars(job, report, job.start_step + clock.steps)
    elif job.metrics is not None:
        job.metrics.close()
    return report, writes


def _faults(job: Job) -> dict[str, object]:
    """Restarts, the steps they redid, and what this rank's checkpoints cost."""
    if not job.config.checkpoint.dir and not job.config.checkpoint.max_restarts:
        return {}
    saves = job.checkpointer.stats.summary() if job.checkpointer is not None else {}
    return {
        "restarts": restarts(),
        "steps_redone": job.redone,
        "resumed_from_step": job.start_step,
        "first_step_unix_s": job.first_step_at,
        "checkpoint_async": job.config.checkpoint.asynchronous,
        **{f"checkpoint_{k}": v for k, v in saves.items()},
        **({"membership": job.membership} if job.membership else {}),
    }
