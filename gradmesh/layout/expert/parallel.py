"""The expert-parallel step: each mixture of experts (`gradmesh.models.moe.MoE`) keeps this
rank's E / ep experts (sliced from the whole model every rank built alike, as the tensor
split slices its layers) and dispatches its tokens to them by all-to-all (`dispatch`).

The ep ranks take different samples (a data-parallel axis for everything but the experts),
so the rest of the model is averaged over them as over replicas (`gradmesh.runtime.mesh`,
`Mesh.replicas`). An expert's gradient already gathers every ep rank's tokens: it is averaged
over the copies of that expert only (`Mesh.experts`: the replicas but the ep axis; none when
dp and cp are 1), after a division by ep, so that it is the global batch's mean as the
others' are. Each parameter is marked (`EXPERT_PLACED`) for the optimizer and the first
broadcast to find."""

from __future__ import annotations

from typing import Any

from torch import nn

from gradmesh.errors import GradmeshError
from gradmesh.layout.expert.dispatch import dispatcher
from gradmesh.models.moe import MoE
from gradmesh.runtime.axes import EP
from gradmesh.runtime.mesh import EXPERT_PLACED

EXPERT_WEIGHTS = ("w1", "b1", "w2", "b2")


def mixtures(model: nn.Module) -> list[tuple[str, MoE]]:
    return [(name, m) for name, m in model.named_modules() if isinstance(m, MoE)]


def check_expert(model: nn.Module, model_name: str, ep: int, pp: int = 1) -> None:
    """One line, before launch, unless `model`'s mixtures spread over `ep` ranks (and, with
    mixtures, unless there is no pipeline)."""
    check_mixtures({name: moe.experts for name, moe in mixtures(model)}, model_name, ep, pp)


def check_mixtures(experts: dict[str, int], model_name: str, ep: int, pp: int = 1) -> None:
    """`check_expert` on the mixtures' expert counts (name -> experts; the simulator's are
    counted on the meta device)."""
    if experts and pp > 1:
        raise GradmeshError(
            f"--pipeline-parallel {pp}: model {model_name} has mixtures of experts, whose "
            "routing depends on its tokens' values, which a pipeline's traced stage graphs "
            "cannot hold"
        )
    if ep == 1:
        return
    if not experts:
        raise GradmeshError(
            f"--expert-parallel {ep}: model {model_name} has no mixture of experts to spread "
            "(gradmesh's GPT has them with --model-args experts=8,top_k=2)"
        )
    for name, count in experts.items():
        if count % ep:
            raise GradmeshError(
                f"--expert-parallel {ep}: {model_name}'s mixture {name} has {count} "
                f"experts, which {ep} ranks cannot hold equally"
            )


def expert_parallel(model: nn.Module, model_name: str, rt: Any) -> dict[str, Any]:
    """The recipe's expert step, in place: this rank's experts of every mixture, dispatched to
    over the ep axis; the report's entries on it ({} without mixtures)."""
    axis = rt.mesh[EP]
    found = mixtures(model)
    if not found:
        return {}
    check_expert(model, model_name, axis.size)
    if axis.size > 1:
        for _, moe in found:
            _keep_mine(moe, axis.size, axis.index)
            moe.dispatch = dispatcher(axis)
    moe = found[0][1]
    return {
        "experts": moe.experts,
        "experts_per_rank": moe.experts // axis.size,
        "top_k": moe.top_k,
        "routing": f"capacity {moe.capacity:g}" if moe.capacity else "dropless",
    }


def _keep_mine(moe: MoE, ep: int, index: int) -> None:
    per = moe.experts // ep
    for name in EXPERT_WEIGHTS:
        whole = getattr(moe, name)
        mine = nn.Parameter(whole.detach()[index * per : (index + 1) * per].clone())
        setattr(mine, EXPERT_PLACED, True)
        mine.register_hook(lambda g: g / ep)  # type: ignore[no-untyped-call]  # every ep rank's tokens: to the global mean  # type: ignore[no-untyped-call]
        setattr(moe, name, mine)
