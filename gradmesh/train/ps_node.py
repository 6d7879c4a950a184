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
    if config.timeline:
        from gradmesh.observe.timeline import Timeline, job_clock

        merged = not config.timeline_per_rank
        job = job_clock(index, config.timeout_s) if merged else None
        path = config.timeline if merged else role_path(config.timeline, f"server{index}")
        name = f"server {index}"
        timeline = Timeline(path, index, name, config.timeline_steps, "serving", job)
    run_server(
        index,
        config.servers,
        config.workers,
        store_host,
        store_port,
        config.timeout_s,
        checkpoints=ShardFolder(config.checkpoint_dir, config.identity())
        if config.checkpoint_dir
        else None,
        on_update=fault.check if fault is not None and fault.kind == "kill" else None,
        mode=config.mode,
        max_staleness=config.max_staleness,
        staleness_lr=config.staleness_lr,
        optimizer=config.server_optimizer,
        lr=gradient_lr(config.lr, config.mode, config.workers),
        momentum=config.momentum,
        weight_decay=config.weight_decay,
        lost_after_s=config.lost_after_s,
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
    try:
        if world != config.servers + config.workers:
            raise GradmeshError(
                f"a ps job of {config.servers} servers and {config.workers} workers needs "
                f"{config.servers + config.workers} ranks, the launcher started {world}"
            )
        if rank < config.servers:
            return serve(config, rank, host, port)
        index = rank - config.servers
        # a supervisor imports no torch when the launcher drew the token: it starts faster
        token = launcher_token() or job_token(connect_store(host, port, config.timeout_s), False)
        if config.timeline and config.timeline_per_rank:
            config.timeline = role_path(config.timeline, f"worker{index}")
        command = [sys.executable, "-m", "gradmesh.train.worker", "--config", config.to_json()]
        survivable = not config.checkpoint_dir  # a checkpoint needs every worker's part
        return supervise_worker(command, index, config.workers, token, survivable)
    except GradmeshError as exc:
        print(f"gradmesh: {on_rank(rank, exc)}", file=sys.stderr, flush=True)
        return 1


if __name__ == "__main__":
    sys.exit(main())
