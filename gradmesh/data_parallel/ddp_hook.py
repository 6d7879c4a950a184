"""gradmesh's reducer as a torch DDP communication hook, for people who keep DDP.

    ddp.register_comm_hook(None, gradmesh.ddp_comm_hook(allreduce="ring", compression="fp16"))

DDP hands over each gradient bucket as it becomes ready; the hook reduces it on gradmesh's
communication thread (over the runtime's second process group, so DDP's own collectives never
interleave with it) and completes DDP's future with the average.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from gradmesh.collectives import ALGORITHMS
from gradmesh.compression import Codec, resolve
from gradmesh.data_parallel.api import compressed_allreduce
from gradmesh.runtime import get_runtime

Hook = Callable[[Any, Any], torch.futures.Future[torch.Tensor]]
"""hook(state, bucket: torch.distributed.GradBucket) -> Future[Tensor]"""


def ddp_comm_hook(allreduce: str = "native", compression: Codec | str | None = None) -> Hook:
    """A DDP comm hook averaging each bucket with the named algorithm and codec."""
    name = allreduce
    ALGORITHMS.get(name)
    codec = resolve(compression)
    rt = get_runtime()

    def reduce(buffer: torch.Tensor) -> torch.Tensor:
        return compressed_allreduce(buffer, codec, "average", name, rt.async_group)

    def hook(_state: Any, bucket: Any) -> torch.futures.Future[torch.Tensor]:
        future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        job = rt.comm_executor().submit(reduce, bucket.buffer())

        def done(finished: Any) -> None:
            try:
                future.set_result(finished.result())
            except Exception as exc:  # noqa: BLE001 - DDP re-raises it in the training thread
                future.set_exception(exc)  # type: ignore[arg-type]

        job.add_done_callback(done)
        return future

    # DDP checks the hook's annotations against the real classes, not their names
    hook.__annotations__.update(
        bucket=torch.distributed.GradBucket,  # type: ignore[attr-defined]
        **{"return": torch.futures.Future[torch.Tensor]},
    )
    return hook
