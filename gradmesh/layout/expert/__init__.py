"""Expert parallelism (the ep axis): a mixture's experts spread over ranks, tokens dispatched
to them and back by all-to-all (`dispatch`); `parallel` is the recipe's step and the check
before launch."""

from gradmesh.layout.expert.parallel import check_expert, expert_parallel

__all__ = ["check_expert", "expert_parallel"]
