"""Which of `gradmesh simulate`'s options each pricing reads: a token model on the mesh
(`mesh_command.run_mesh`), an image model by its strategies (`strategies.STRATEGIES`). An option
given to a pricing that would not read it is refused in one line, never silently dropped."""

from __future__ import annotations

from typing import Any

from gradmesh.options import options_of, refuse_others, refuse_unread

TOKEN_ONLY = (
    "data.sequence_length",
    "vocab",
    "async_tp",
    "context_gather",
    "loss_parallel",
    "global_batch",
    "optimizer",
    "zero_stage",
    "search",
    "top",
    "layout.context_parallel",
    "layout.context_attention",
    "layout.expert_parallel",
    "layout.sequence_parallel",
    "layout.activation_checkpointing",
)
"""Options only the pricing of a token model on the mesh (`run_mesh`) reads."""
BY_STRATEGY = {
    "ps": ("ps.servers", "servers_per_node"),
    "local-sgd": ("local_sgd.sync_every",),
    "tensor": ("layout.tensor_parallel",),
    "hybrid": ("layout.tensor_parallel",),
    "pipeline": (
        "layout.pipeline_parallel",
        "layout.microbatches",
        "layout.schedule",
        "layout.virtual_stages",
    ),
}
"""The options of an image model's strategies that only that strategy reads."""
IMAGE_ONLY = ("input_shape", "allreduce.fusion_mb", *BY_STRATEGY["ps"], *BY_STRATEGY["local-sgd"])
"""Options only the pricing of an image model by --strategy reads (a token model's mesh reads
the tensor and pipeline ones)."""


def refuse_unread_by_validate(args: Any) -> None:
    """`--validate` prices the published table's own runs: a job's options are refused with
    it, and `--published` without it."""
    if not args.validate:
        refuse_unread(args, ("published",), "the table --validate prices")
        return
    job = [
        o.dest for o in options_of(type(args)) if o.dest not in ("validate", "published", "json")
    ]
    refuse_unread(args, job, "not read by --validate, which prices the published runs as they ran")


def refuse_unread_by_token_model(args: Any) -> None:
    """A token model is priced on the mesh: the image models' options are refused."""
    refuse_unread(
        args, IMAGE_ONLY, f"options of image models; model {args.data.model} is priced on the mesh"
    )


def refuse_unread_by_image_model(args: Any, strategies: list[str]) -> None:
    """An image model is priced by `strategies`: the token models' options, and those of the
    strategies not asked for, are refused."""
    refuse_unread(
        args,
        TOKEN_ONLY,
        f"options of token models (gpt, hf:..., a factory); model {args.data.model} is priced "
        "by --strategy",
    )
    asked = {d for s in strategies for d in BY_STRATEGY.get(s, ())}
    refuse_others(args, BY_STRATEGY, strategies, asked, f"--strategy {args.strategy}")
