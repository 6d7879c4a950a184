"""The process `gradmesh train --strategy ps` starts on every rank: ranks 0..S-1 serve a shard,
the others each supervise one training worker (see `roles`). With `--checkpoint-dir` a server
resumes its shard from the newest complete checkpoint and writes its part of each new one when
the first worker asks (`Server`); a killed worker then fails its rank, so that the launcher
restarts the whole job (`--max-restarts`) from the checkpoint, or ends it."""

from __future__ import annotations

import argparse
import json
import os
import sys

from gradmesh.errors import GradmeshError, on_rank
from gradmesh.runtime.ending import INTERRUPTED_EXIT, interrupt_once
from gradmesh.runtime.process import bind_to_launcher, connect_store
from gradmesh.sync.parameter_server.roles import (
    job_token,
    launcher_token,
    run_server,
    supervise_worker,
)
from gradmesh.train.config import TrainConfig
from gradmesh.train.faults import injected_fault


def gradient_lr(lr: float, mode: str, workers: int) -> float:
    """The server's step for one pushed gradient when `lr` is the step of one global batch (as
    `--lr` is, with `--batch-size` global): sync applies the average of the W workers' gradients
    once, so `lr`; async and ssp apply each worker's gradient of its 1/W of the batch on its own,
    so `lr / W`, which moves the model as far per global batch as sync does. Without it, async
    training at the defaults stepped W times too far and fell short (0.894 on digits, W = 2)."""
    return lr if mode == "sync" else lr / workers


def role_path(path: str, role: str) -> str:
    """A per-rank timeline's file for a server or worker: `t.json` -> `t.server0.json`."""
    stem, dot, ext = path.rpartition(".")
    return f"{stem if dot else path}.{role}.{ext if dot else 'json'}"


def serve(config: TrainConfig, index: int, store_host: str, store_port: int) -> int:
    from gradmesh.train.checkpoint import ShardFolder  # torch: servers only

    fault = injected_fault()
    timeline = None
    if config.output.timeline:
        from gradmesh.observe.timeline import Timeline, job_clock

        merged = not config.output.timeline_per_rank
        job = job_clock(index, config.job.timeout_s) if merged else None
        path = (
            config.output.timeline
            if merged
            else role_path(config.output.timeline, f"server{index}")
        )
        name = f"server {index}"
        timeline = Timeline(path, index, name, config.output.timeline_steps, "serving", job)
    run_server(
        index,
        config.sync.ps.servers,
        config.job.workers,
        store_host,
        store_port,
        config.job.timeout_s,
        checkpoints=ShardFolder(config.checkpoint.dir, config.identity())
        if config.checkpoint.dir
        else None,
        on_update=fault.check if fault is not None and fault.kind == "kill" else None,
        ps=config.sync.ps,
        lr=gradient_lr(config.optimizer.lr, config.sync.ps.mode, config.job.workers),
        momentum=config.optimizer.momentum,
        weight_decay=config.optimizer.weight_decay,
        timeline=timeline,
    )
    if timeline is not None:
        timeline.save()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gradmesh-ps-node")
    parser.add_argument("--config", required=True, help="TrainConfig as JSON")
    args = parser.parse_args(argv)
    config = TrainConfig.from_mapping(json.loads(args.config), "--config")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    bind_to_launcher(rank)  # servers and supervisors join no process group, so say it here
    interrupt_once()
    try:
        servers, workers = config.sync.ps.servers, config.job.workers
        if world != servers + workers:
            raise GradmeshError(
                f"a ps job of {servers} servers and {workers} workers needs "
                f"{servers + workers} ranks, the launcher started {world}"
            )
        if rank < config.sync.ps.servers:
            return serve(config, rank, host, port)
        index = rank - config.sync.ps.servers
        # a supervisor imports no torch when the launcher drew the token: it starts faster
        token = launcher_token() or job_token(
            connect_store(host, port, config.job.timeout_s), False
        )
        if config.output.timeline and config.output.timeline_per_rank:
            config.output.timeline = role_path(config.output.timeline, f"worker{index}")
        command = [sys.executable, "-m", "gradmesh.train.worker", "--config", config.to_json()]
        survivable = not config.checkpoint.dir  # a checkpoint needs every worker's part
        return supervise_worker(command, index, config.job.workers, token, survivable)
    except GradmeshError as exc:
        print(f"gradmesh: {on_rank(rank, exc)}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:  # Ctrl-C: the launcher's one line says so for the job
        return INTERRUPTED_EXIT


if __name__ == "__main__":
    sys.exit(main())
