"""ZeRO stage 1 on the optimizer's side: torch's `ZeroRedundancyOptimizer` over the
data-parallel group (`shard_optimizer`), and what a checkpoint keeps of it
(`optimizer_state_dict`). The model's side (stages 2 and 3, FSDP2) is
`gradmesh.sync.sharded.model`."""

from __future__ import annotations

import functools
import inspect
import sys
from typing import Any

from torch.optim import Optimizer

from gradmesh.collectives.api import exchanged
from gradmesh.runtime.axes import DP
from gradmesh.runtime.world import Runtime


def shard_optimizer(optimizer: Optimizer, stage: int, rt: Runtime) -> Optimizer:
    """Stage 1: `optimizer` (already built over the model's parameters) remade as a
    `ZeroRedundancyOptimizer` of the same class and settings over the dp group. The parameters
    become views of one buffer a replica's part (torch's `parameters_as_bucket_view`), so that
    each replica sends its updated part in one message: give a parameter new values in place
    (`copy_`), never a new `.data`, or the others would not see them."""
    if stage != 1:
        return optimizer
    params = [p for group in optimizer.param_groups for p in group["params"]]
    takes = inspect.signature(type(optimizer).__init__).parameters  # defaults hold more
    settings = {k: v for k, v in optimizer.defaults.items() if k in takes}
    sharded: Optimizer = _counted_class()(
        params,
        optimizer_class=type(optimizer),
        process_group=rt.mesh[DP].group,
        parameters_as_bucket_view=True,  # one message a part, not one a parameter
        **settings,
    )
    return sharded


@functools.cache
def _counted_class() -> Any:
    """`ZeroRedundancyOptimizer` with its parameter exchange counted as the step's data-parallel
    traffic (`rt.comm`, "sync") and drawn on the timeline: after each replica steps its part,
    it broadcasts that part to the n - 1 others (counted on its owner, which together is what
    the n ranks receive), and the seconds until every part has arrived. Torch's class does the
    work; its `_sync_params` (one broadcast per replica's part, waited for) is overridden to be
    timed, a private method of the torch this project pins. Made on first use: importing
    torch's module takes 0.7 s, which ranks without ZeRO do not pay."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    class CountedZeroRedundancyOptimizer(ZeroRedundancyOptimizer):
        forwards_found_inf = True
        """fp16's overflow flag (`found_inf`, as `GradScaler` hands it) goes to the optimizer
        of this replica's part, whose step skips or not (`gradmesh.train.loss_scale`)."""

        @property
        def _step_supports_amp_scaling(self) -> bool:
            return bool(getattr(self.optim, "_step_supports_amp_scaling", False))

        def step(self, closure: Any = None, **kwargs: Any) -> Any:
            found = vars(self).get("found_inf")
            if found is not None:
                self.optim.found_inf = found
            try:
                return super().step(closure, **kwargs)
            finally:
                vars(self.optim).pop("found_inf", None)

        def _sync_params(self) -> None:
            mine = [p for group in self.optim.param_groups for p in group["params"]]
            part = sum(p.numel() * p.element_size() for p in mine)
            with exchanged("zero-1 broadcast", (self.world_size - 1) * part):
                super()._sync_params()  # type: ignore[misc]

    return CountedZeroRedundancyOptimizer


def optimizer_sharded(optimizer: Any) -> bool:
    """Whether each rank holds only its part of `optimizer`'s state (stage 1). Torch's module
    is looked up, not imported: it takes 0.7 s to import, which every rank writing a
    checkpoint would pay, and an optimizer of its class exists only once it is imported."""
    module = sys.modules.get("torch.distributed.optim.zero_redundancy_optimizer")
    return module is not None and isinstance(optimizer, module.ZeroRedundancyOptimizer)


def optimizer_state_dict(optimizer: Any) -> dict[str, Any]:
    """What a rank's checkpoint keeps of `optimizer`: its state dict; at stage 1 this rank's
    part of it, in the whole optimizer's form (entries by the index of the parameter among
    all the optimizer's, every parameter group), which `ZeroRedundancyOptimizer.load_state_dict`
    takes back at the same layout and the replicas' files together make whole
    (`gradmesh.train.checkpoint.whole_state`). Torch's own way, `consolidate_state_dict`,
    would send every rank's state to one rank pickled, which gradmesh does not take from the
    network."""
    if not optimizer_sharded(optimizer):
        return dict(optimizer.state_dict())
    params = [p for group in optimizer.param_groups for p in group["params"]]
    index = {id(p): i for i, p in enumerate(params)}
    state = {index[id(p)]: dict(entry) for p, entry in optimizer.optim.state.items()}
    groups = [
        {
            **{k: v for k, v in group.items() if k != "params"},
            "params": [index[id(p)] for p in group["params"]],
        }
        for group in optimizer.param_groups
    ]
    return {"state": state, "param_groups": groups}
