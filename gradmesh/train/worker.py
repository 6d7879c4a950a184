"""The process `gradmesh train` starts on every rank: join the job, train, report, leave."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from torch.distributed.elastic.multiprocessing.errors import record

from gradmesh.errors import GradmeshError, on_rank, torch_collective_failure
from gradmesh.runtime.ending import INTERRUPTED_EXIT, exit_process, interrupt_once
from gradmesh.runtime.world import init, mark_failed, shutdown
from gradmesh.train.config import TrainConfig
from gradmesh.train.trainer import train


@record
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gradmesh-worker")
    parser.add_argument("--config", required=True, help="TrainConfig as JSON")
    args = parser.parse_args(argv)
    config = TrainConfig.from_mapping(json.loads(args.config), "--config")
    rank = "?"
    interrupt_once()
    try:
        rt = init(timeout_s=config.job.timeout_s, mesh=config.layout.mesh_sizes())
        rank = str(rt.rank)
        report, writes = train(config, rt)
        if writes:
            print(report.summary(), flush=True)
            if config.output.json:
                Path(config.output.json).write_text(report.to_json() + "\n")
    except GradmeshError as exc:
        print(f"gradmesh: {on_rank(rank, exc)}", file=sys.stderr, flush=True)
        return mark_failed(exc)
    except KeyboardInterrupt as exc:  # Ctrl-C, or the launcher passing on its SIGINT: the
        mark_failed(exc)  # launcher's one line says so for the job, no traceback from each rank
        return INTERRUPTED_EXIT
    except RuntimeError as exc:  # torch's own collectives (FSDP2, ZeroRedundancyOptimizer)
        failure = torch_collective_failure(exc, rank)
        if failure is None:
            raise
        print(f"gradmesh: {failure}", file=sys.stderr, flush=True)
        return mark_failed(failure)
    finally:
        shutdown()
    return 0


if __name__ == "__main__":
    exit_process(main() or 0)
