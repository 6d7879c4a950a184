"""Context parallelism (the cp axis): long sequences split over ranks, attention exchanging keys
and values around a ring (`ring`) or heads for sequence by all-to-all (`ulysses`), on
load-balanced causal chunks (`chunks`); `parallel` is the recipe's step and the check before
launch."""

from gradmesh.layout.context.parallel import check_context, context_parallel

__all__ = ["check_context", "context_parallel"]
