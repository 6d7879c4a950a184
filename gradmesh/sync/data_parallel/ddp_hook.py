"""gradmesh's reducer as a torch DDP communication hook, for people who keep DDP.

    ddp.register_comm_hook(None, gradmesh.ddp_comm_hook(allreduce="ring", compression="fp16"))

DDP hands over each gradient bucket as it becomes ready; the hook reduces it on gradmesh's
communication thread (over the runtime's second process group, so DDP's own collectives never
interleave with it) and completes DDP's future with the average. A compressor keeps one state
per DDP bucket (its error-feedback residual, PowerSGD's Q), made when the bucket first comes,
with the bucket's parameter shapes (PowerSGD compresses each matrix on its own), and made again
when DDP rebuilds its buckets: the same size in another order is another layout.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from gradmesh.collectives import ALGORITHMS
from gradmesh.compression.base import Compressor, Link, State
from gradmesh.compression.registry import reduce, resolve
from gradmesh.runtime.world import get_runtime

Hook = Callable[[Any, Any], torch.futures.Future[torch.Tensor]]
"""hook(state, bucket: torch.distributed.GradBucket) -> Future[Tensor]"""


def ddp_comm_hook(allreduce: str = "native", compression: Compressor | str | None = None) -> Hook:
    """A DDP comm hook averaging each bucket with the named algorithm and compressor."""
    ALGORITHMS.get(allreduce)
    compressor = resolve(compression)
    rt = get_runtime()  # its own group: the world's negotiation group is Horovod's coordinator's
    link = Link(rt.new_group("DDP comm hook") if rt.size > 1 else None, allreduce)
    states: dict[int, State] = {}

    def average(index: int, buffer: torch.Tensor, shapes: list[tuple[int, ...]]) -> torch.Tensor:
        known = states.get(index)
        if known is None or known.shapes != shapes:  # DDP rebuilds its buckets after step one,
            states[index] = compressor.new_state(buffer.numel(), shapes)  # in a new order
        reduce(buffer, compressor, states[index], link)
        return buffer.div_(link.size)

    def hook(_state: Any, bucket: Any) -> torch.futures.Future[torch.Tensor]:
        future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        shapes = [tuple(g.shape) for g in bucket.gradients()]
        job = rt.comm_executor().submit(average, bucket.index(), bucket.buffer(), shapes)

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
