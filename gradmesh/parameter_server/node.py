"""The process `gradmesh train --strategy ps` starts on every rank: ranks 0..S-1 serve a shard,
the others each supervise one training worker (see `roles`)."""

from __future__ import annotations

import argparse
import json
import os
import sys

from gradmesh.errors import GradmeshError
from gradmesh.parameter_server.roles import (
    KEY,
    connect_store,
    job_token,
    local_address,
    supervise_worker,
)
from gradmesh.parameter_server.server import Server, ServerConfig
from gradmesh.train.config import TrainConfig


def serve(config: TrainConfig, index: int, store_host: str, store_port: int) -> int:
    store = connect_store(store_host, store_port, config.timeout_s)
    token = job_token(store, creator=index == 0)
    total = int(store.get(KEY + "numel").decode())  # published by worker 0
    from gradmesh.parameter_server.client import shard_ranges

    start, end = shard_ranges(total, config.servers)[index]
    server = Server(
        ServerConfig(
            index=index,
            workers=config.workers,
            numel=end - start,
            mode=config.mode,
            max_staleness=config.max_staleness,
            staleness_lr=config.staleness_lr,
            optimizer=config.server_optimizer,
            lr=config.lr,
            momentum=config.momentum,
            weight_decay=config.weight_decay,
            lost_after_s=config.lost_after_s,
            timeout_s=config.timeout_s,
        ),
        token,
        local_address(store_host),
    )
    store.set(KEY + f"server{index}", server.endpoint)
    stats = server.serve()
    print(
        f"gradmesh ps: server {index}: {sum(stats['requests'].values())} requests, "
        f"{stats['bytes_in'] / 1e6:.1f} MB in, {stats['bytes_out'] / 1e6:.1f} MB out, "
        f"{stats['dropped_messages']} dropped",
        file=sys.stderr,
        flush=True,
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gradmesh-ps-node")
    parser.add_argument("--config", required=True, help="TrainConfig as JSON")
    args = parser.parse_args(argv)
    config = TrainConfig.from_mapping(json.loads(args.config), "--config")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    try:
        if world != config.servers + config.workers:
            raise GradmeshError(
                f"a ps job of {config.servers} servers and {config.workers} workers needs "
                f"{config.servers + config.workers} ranks, the launcher started {world}"
            )
        if rank < config.servers:
            return serve(config, rank, host, port)
        index = rank - config.servers
        store = connect_store(host, port, config.timeout_s)
        token = job_token(store, creator=False)
        if config.timeline:
            stem, dot, ext = config.timeline.rpartition(".")
            base = stem if dot else config.timeline
            config.timeline = f"{base}.worker{index}.{ext if dot else 'json'}"
        command = [sys.executable, "-m", "gradmesh.train.worker", "--config", config.to_json()]
        return supervise_worker(command, index, config.workers, token)
    except GradmeshError as exc:
        print(f"gradmesh: rank {rank}: {exc}", file=sys.stderr, flush=True)
        return 1


if __name__ == "__main__":
    sys.exit(main())
