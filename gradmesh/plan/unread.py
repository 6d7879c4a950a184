"""`gradmesh plan`'s options that the asked planning would not read, refused in one line (as
`gradmesh.train.unread` refuses the trainer's): the links' options outside the link mode that
reads them, a mesh plan's `--top` on a model planned per layer, `--layouts` and `--device`
without `--memory`, and the planning options under `--memory`, which plans nothing."""

from __future__ import annotations

from typing import Any

from gradmesh.options import refuse_unread

LINK_OPTIONS = ("bandwidth", "latency", "ranks_per_host")
"""What `links_for` reads, in each link mode: an emulated cluster its rate, `--bandwidth` all
three, a loopback probe and loopback itself none."""
MEMORY_UNREAD = (
    "synthetic_shape",
    "tensor_parallel_max",
    *LINK_OPTIONS,
    "emulate_hosts",
    "probe",
    "memory_limit",
    "top",
    "allreduce.algorithm",
    "allreduce.fusion_mb",
)
"""What `--memory` (each layout's bytes of a token model, `gradmesh.simulate.memory`) does not
read."""


def check_memory(args: Any) -> None:
    """`gradmesh plan --memory`'s refusals."""
    refuse_unread(args, MEMORY_UNREAD, "not read by --memory, which counts bytes and plans nothing")


def check_plan(args: Any, per_layer: bool) -> None:
    """A plan's refusals (`per_layer`: a sequence of layers, placed layer by layer; else a
    mesh plan)."""
    refuse_unread(args, ("layouts", "device"), "options of --memory")
    reads: tuple[str, ...]
    if args.emulate_hosts:
        mode, reads = "--emulate-hosts, which measures its links", ("bandwidth",)
    elif args.probe:
        mode, reads = "--probe, which measures loopback", ()
    elif args.bandwidth:
        mode, reads = "--bandwidth", LINK_OPTIONS
    else:
        mode, reads = "this host's loopback (no --bandwidth)", ()
    unread = [o for o in LINK_OPTIONS if o not in reads]
    refuse_unread(args, unread, f"not read by a plan on {mode}")
    if per_layer:
        refuse_unread(
            args,
            ("top", "sequence_length"),
            f"options of a mesh plan; model {args.model} is a sequence of layers, planned layer "
            "by layer",
        )
