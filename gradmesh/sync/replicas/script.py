"""Replica groups from a script of one's own: `gradmesh.ReplicaGroup` (what `gradmesh train
--replica-group` does, for the loop, model and loss a user writes).

    group = gradmesh.ReplicaGroup(model, optimizer, lighthouse="h0:29600", group=G, groups=R)
    while group.steps < last:
        if not group.start_step():     # the step's quorum; the newest state copied when behind
            break                      # the run ended (another group took the last step)
        x, y = batch(group.steps, group.quorum.index, len(group.quorum.members))
        group.optimizer.zero_grad()
        loss_fn(model(x), y).backward()
        group.step()                   # averaged over the groups alive, committed, applied;
                                       # False: not committed, the same step is taken again
    group.finish()

Each group is a job of its own (`gradmesh run -np N script.py`, with `--max-restarts` to bring
a killed group back); `optimizer` may already be a `gradmesh.DistributedOptimizer` (the group's
own data parallelism: it runs first). The copy a joining group receives holds the model's and
the optimizer's state dicts, the step, the average's shared compressor state and, with
`state=(save, load)`, whatever else the script keeps (a scheduler, a data position). The run's
identity, which every group must share, defaults to the model's parameter names and shapes
and the group's size: a group of another model is refused in one line.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from typing import Any

from torch import nn
from torch.optim import Optimizer

from gradmesh.compression.registry import make
from gradmesh.runtime.world import get_runtime
from gradmesh.sync.replicas.averaging import CrossGroupAverage
from gradmesh.sync.replicas.manager import Quorum, ReplicaManager, StepAborted
from gradmesh.sync.replicas.optimizer import ReplicaOptimizer


def model_identity(model: nn.Module, size: int) -> str:
    """A readable and hashed name of `model`'s parameters (names, shapes, dtypes) and the
    group's size: what groups of one run share."""
    shapes = [(n, tuple(p.shape), str(p.dtype)) for n, p in model.named_parameters()]
    digest = hashlib.sha256(repr((shapes, size)).encode()).hexdigest()[:12]
    count = sum(p.numel() for p in model.parameters())
    return f"a script's model of {count} parameters, {size} ranks a group, {digest}"


class ReplicaGroup:
    """This process's part of one replica group (see the module docstring)."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: Optimizer,
        *,
        lighthouse: str,
        group: int,
        groups: int,
        compression: str = "none",
        timeout_s: float = 10.0,
        identity: str | None = None,
        state: tuple[Callable[[], dict[str, Any]], Callable[[dict[str, Any]], None]] | None = None,
    ) -> None:
        rt = get_runtime()
        self.model, self.steps, self._extra = model, 0, state
        self._began: float | None = None
        self.manager = ReplicaManager(
            group,
            groups,
            lighthouse,
            identity or model_identity(model, rt.size),
            rt,
            timeout_s,
            averaging=CrossGroupAverage(make(compression)),
        )
        params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = ReplicaOptimizer(optimizer, self.manager, params, lambda: self.steps)

    @property
    def quorum(self) -> Quorum:
        """The step's quorum (after `start_step`): `members`, this group's `index` among them."""
        assert self.manager.quorum is not None, "call start_step() first"
        return self.manager.quorum

    def start_step(self) -> bool:
        """Block for this step's quorum; where a member is behind, every member takes part in
        the copy of the newest state (this group's `steps` moves to the quorum's when it was
        behind). False where the run is over (said in a line)."""
        self._began = self._began or time.perf_counter()
        while True:
            quorum = self.manager.start_step(self.steps)
            if quorum is None:
                return False
            if not quorum.recovering or self.manager.recover(self._state, self._load):
                if quorum.behind:
                    self.steps = quorum.max_step
                return True

    def step(self) -> bool:
        """Average the gradients over the quorum, commit and apply; False where a member was
        lost mid-step (nothing applied anywhere: take the same step again)."""
        try:
            self.optimizer.step()
        except StepAborted:
            return False
        self.steps += 1
        if self._began is not None:  # from the step's first quorum request to its commit
            self.manager.step_seconds[self.steps - 1] = time.perf_counter() - self._began
            self._began = None
        return True

    def finish(self) -> None:
        """Tell the lighthouse this group took the run's last step."""
        self.manager.finish(self.steps)

    def report(self) -> dict[str, Any]:
        """Quorum changes, copies received, steps taken again, step times."""
        return self.manager.report()

    def _state(self) -> dict[str, Any]:
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "step": self.steps,
            "averaging": self.manager.averaging.shared(),
            "extra": self._extra[0]() if self._extra else {},
        }

    def _load(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.manager.averaging.load_shared(state["averaging"])
        if self._extra:
            self._extra[1](state["extra"])
