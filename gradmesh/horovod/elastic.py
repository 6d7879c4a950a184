"""Horovod's elastic API (`hvd.elastic`) for a job whose membership does not change.

An elastic Horovod script keeps its training state in a `TorchState`, commits it every few
batches, and runs its loop under `@hvd.elastic.run`, which syncs the state from rank 0 first and,
when a worker is lost, restores the last commit and goes on with the workers left. gradmesh runs
such scripts unchanged with the state, commit, restore, sync and `ElasticSampler` behaving as in
Horovod; recovery from a lost worker needs gradmesh's automatic restart (issue 15), so a peer's
failure inside `run` ends the job with one line saying so, after restoring the last commit.
"""

from __future__ import annotations

import copy
import functools
import math
import random
from collections.abc import Callable, Iterator
from typing import Any

import torch

from gradmesh.collectives import allgather_object, broadcast_object
from gradmesh.errors import PeerFailure
from gradmesh.runtime.world import rank, size
from gradmesh.sync.data_parallel.api import broadcast_optimizer_state
from gradmesh.sync.data_parallel.optimizer import broadcast_parameters

RECOVERY = (
    "recovering from a lost worker needs gradmesh's elastic restart (issue 15), not built yet"
)


class State:
    """Training state kept by `run`: `commit()` saves it, `restore()` returns to the last save,
    `sync()` gives every rank rank 0's. Extra keyword arguments become attributes (epoch, batch)
    that travel as plain values."""

    def __init__(self, **kwargs: Any) -> None:
        self._callbacks: list[Callable[[], None]] = []
        self._values = dict(kwargs)
        self._saved_values = copy.deepcopy(self._values)

    def __getattr__(self, name: str) -> Any:
        values = self.__dict__.get("_values", {})
        if name in values:
            return values[name]
        raise AttributeError(name)

    def __setattr__(self, name: str, value: Any) -> None:
        if not name.startswith("_") and name in self.__dict__.get("_values", {}):
            self._values[name] = value
        else:
            super().__setattr__(name, value)

    def register_reset_callbacks(self, callbacks: list[Callable[[], None]]) -> None:
        """Callbacks run after the world changes (never, until issue 15)."""
        self._callbacks.extend(callbacks)

    def on_reset(self) -> None:
        for callback in self._callbacks:
            callback()

    def commit(self) -> None:
        self.save()
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """Horovod raises when hosts were added or removed; gradmesh's world is fixed."""

    def save(self) -> None:
        self._saved_values = {
            k: v.state_dict() if isinstance(v, ElasticSampler) else copy.deepcopy(v)
            for k, v in self._values.items()
        }

    def restore(self) -> None:
        for k, saved in self._saved_values.items():
            if isinstance(self._values[k], ElasticSampler):
                self._values[k].load_state_dict(saved)
            else:
                self._values[k] = copy.deepcopy(saved)

    def sync(self) -> None:
        """Rank 0's plain values everywhere; each sampler's processed indices merged."""
        samplers = {k: v for k, v in self._values.items() if isinstance(v, ElasticSampler)}
        plain = {k: v for k, v in self._values.items() if k not in samplers}
        self._values.update(broadcast_object(plain, root_rank=0))
        for sampler in samplers.values():
            done = allgather_object(sorted(sampler.processed_indices))
            sampler.load_state_dict(
                {"epoch": sampler.epoch, "processed_indices": sorted(set().union(*done))}
            )


ObjectState = State


class TorchState(State):
    """State with a model and an optimizer (saved as copies of their state dicts in memory)."""

    def __init__(
        self,
        model: torch.nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        **kwargs: Any,
    ) -> None:
        self.__dict__["model"] = model
        self.__dict__["optimizer"] = optimizer
        super().__init__(**kwargs)
        self._saved_model = self._model_state()
        self._saved_optimizer = self._optimizer_state()

    def _model_state(self) -> Any:
        return None if self.model is None else copy.deepcopy(self.model.state_dict())

    def _optimizer_state(self) -> Any:
        return None if self.optimizer is None else copy.deepcopy(self.optimizer.state_dict())

    def save(self) -> None:
        super().save()
        self._saved_model = self._model_state()
        self._saved_optimizer = self._optimizer_state()

    def restore(self) -> None:
        super().restore()
        if self.model is not None:
            self.model.load_state_dict(self._saved_model)
        if self.optimizer is not None:
            self.optimizer.load_state_dict(self._saved_optimizer)

    def sync(self) -> None:
        if self.model is not None:
            broadcast_parameters(self.model.state_dict(), root_rank=0)
        if self.optimizer is not None:
            broadcast_optimizer_state(self.optimizer, root_rank=0)
        super().sync()
        self.save()


def run(func: Callable[..., Any]) -> Callable[..., Any]:
    """Horovod's `@hvd.elastic.run`: `func(state, ...)` after syncing `state` from rank 0."""

    @functools.wraps(func)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> Any:
        state.sync()
        try:
            return func(state, *args, **kwargs)
        except PeerFailure as exc:
            state.restore()
            raise PeerFailure(f"{exc} ({RECOVERY}; the last commit was restored)") from None

    return wrapper


class ElasticSampler(torch.utils.data.Sampler[int]):
    """Horovod's elastic sampler: this rank's share of the indices not yet processed this epoch
    (`record_batch` marks them), shuffled by `seed` + epoch; its `state_dict` travels with the
    state so a restored run skips what was done."""

    def __init__(self, dataset: Any, shuffle: bool = True, seed: int = 0) -> None:
        self.dataset, self.shuffle, self.seed = dataset, shuffle, seed
        self.epoch = 0
        self.processed_indices: set[int] = set()
        self.reset()

    def set_epoch(self, epoch: int) -> None:
        """A new epoch: nothing processed yet."""
        self.epoch = epoch
        self.processed_indices = set()
        self.reset()

    def get_indices(self, batch_idx: int, batch_size: int) -> list[int]:
        """This rank's indices in its batch `batch_idx` since the last reset."""
        return self.indices[batch_idx * batch_size : (batch_idx + 1) * batch_size]

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """Mark this rank's batch `batch_idx` as processed (`sync` merges the ranks')."""
        self.record_indices(self.get_indices(batch_idx, batch_size))

    def record_indices(self, indices: list[int]) -> None:
        self.processed_indices.update(indices)

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "processed_indices": sorted(self.processed_indices)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch = state["epoch"]
        self.processed_indices = set(state["processed_indices"])
        self.reset()

    def reset(self) -> None:
        """Re-shard what is left over the current world."""
        self.num_replicas, self.rank = size(), rank()
        order = list(range(len(self.dataset)))
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(order)
        self.remaining_indices = [i for i in order if i not in self.processed_indices]
        self.num_samples = math.ceil(len(self.remaining_indices) / self.num_replicas)
        padded = (
            self.remaining_indices
            + self.remaining_indices[
                : self.num_samples * self.num_replicas - len(self.remaining_indices)
            ]
        )
        self.indices = padded[self.rank :: self.num_replicas]

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return self.num_samples
