"""A training process's side of a parameter-server job: its parameters become views of one flat
vector that pulls overwrite; its optimizer's `step()` pushes the (accumulated) gradient every
`push_every` steps and pulls every `pull_every`, applying nothing locally (Downpour)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from gradmesh.collectives.flat import flat_buffers, views
from gradmesh.compression.base import Compressor, load_states, save_states
from gradmesh.errors import GradmeshError
from gradmesh.runtime.process import connect_store
from gradmesh.runtime.world import get_runtime, is_initialized
from gradmesh.sync.parameter_server.client import Client
from gradmesh.sync.parameter_server.roles import WorkerRole, job_token, key
from gradmesh.sync.wrapping import wrap_optimizer


class PSWorker:
    """Long-lived state of one worker: the flat parameters, the gradient accumulator, counters."""

    def __init__(
        self,
        role: WorkerRole,
        servers: int,
        push_every: int,
        pull_every: int,
        timeout_s: float,
        compressor: Compressor | None = None,
    ) -> None:
        self.role = role
        self.compressor = compressor
        self.servers = servers
        self.push_every = push_every
        self.pull_every = pull_every
        self.timeout_s = timeout_s
        self.steps = 0
        self.summaries: list[dict[str, Any]] = []
        self.reporter = False
        self.params: list[nn.Parameter] = []
        self.client: Client | None = None
        self.cpu_start = 0.0

    def attach(self, model: nn.Module, optimizer: Optimizer) -> Optimizer:
        """Connect to the servers, start from their values, and wrap `optimizer`."""
        self.params = [p for p in model.parameters() if p.requires_grad]
        if any(p.dtype != torch.float32 for p in self.params):
            raise GradmeshError("the parameter server holds float32 parameters only")
        ((self.flat, _),) = flat_buffers(self.params)
        self.spans = []
        start = 0
        for p, view in zip(self.params, views(self.flat, self.params), strict=True):
            self.spans.append((start, start + p.numel()))
            p.data = view
            start += p.numel()
        self.grad = torch.zeros_like(self.flat)
        store = connect_store(self.role.store_host, self.role.store_port, self.timeout_s)
        if self.role.index == 0:
            store.set(key("numel"), str(self.flat.numel()))
        endpoints = [store.get(key(f"server{i}")).decode() for i in range(self.servers)]
        token = job_token(store, creator=False)
        self.client = Client(
            endpoints, token, self.role.index, self.flat.numel(), self.timeout_s, self.compressor
        )
        if self.role.index == 0:
            self.client.init(self.flat)
        self.client.pull(self.flat)
        self.cpu_start = time.process_time()
        return PSOptimizer(optimizer, self)

    def step(self) -> None:
        assert self.client is not None
        for p, (a, b) in zip(self.params, self.spans, strict=True):
            if p.grad is not None:
                g = p.grad.to_dense() if p.grad.is_sparse else p.grad
                self.grad[a:b] += g.reshape(-1)
        self.steps += 1
        sent, started = self.client.bytes_sent, time.perf_counter()
        push = self.steps % self.push_every == 0
        if self.steps % self.pull_every == 0:
            self._pull(self.grad if push else None)
        elif push:
            self.client.push(self.grad)
        if push:
            self.grad.zero_()
        if is_initialized():
            get_runtime().comm.add(self.client.bytes_sent - sent, time.perf_counter() - started)

    def _pull(self, push: torch.Tensor | None = None) -> None:
        assert self.client is not None
        started = time.perf_counter()
        gap = self.client.pull(self.flat, push)
        timeline = get_runtime().timeline if is_initialized() else None
        if timeline is not None:
            timeline.add("pull", "comm", started, time.perf_counter(), staleness=gap)

    def state_dict(self) -> dict[str, Any]:
        """This worker's counters and compressor states (its gradient accumulator is empty at a
        checkpoint: only sync mode checkpoints, and it pushes every step)."""
        assert self.client is not None
        states = {str(i): state for i, state in enumerate(self.client.states)}
        return {
            "steps": self.steps,
            "clock": self.client.clock,
            "compression": save_states(states),
        }

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        """Restore `state_dict()`'s output; the servers, which restored their own parts, must
        be at this worker's step (sync mode), or the parts are of different checkpoints."""
        assert self.client is not None
        steps, clock = saved["steps"], saved["clock"]
        if type(steps) is not int or type(clock) is not int or min(steps, clock) < 0:
            raise GradmeshError("'steps' and 'clock' must be counts")
        load_states(
            {str(i): state for i, state in enumerate(self.client.states)}, saved["compression"]
        )
        for server, version in enumerate(self.client.versions):
            if version != clock:
                raise GradmeshError(
                    f"server {server} resumed at step {version}, this worker at step {clock}: "
                    "they loaded different checkpoints"
                )
        self.steps, self.client.clock = steps, clock

    def finish(self, samples: int, wall_s: float) -> None:
        """Push what is left, wait for every live worker, and (the reporter) pull the final
        model and close the servers."""
        assert self.client is not None
        if self.steps % self.push_every:
            self.client.push(self.grad)
        cpu_s = time.process_time() - self.cpu_start
        stats = {"samples": samples, "wall_s": wall_s, "steps": self.steps, "cpu_s": cpu_s}
        try:
            self.summaries = self.client.finish(stats)
            self.reporter = self.summaries[0]["reporter"] == self.role.index
            if self.reporter:
                self.client.pull(self.flat)
                self.client.close_servers()
        finally:  # the servers end once every connection DONE went on has closed
            self.client.close()

    def report(self) -> dict[str, Any]:
        first = self.summaries[0] if self.summaries else {}
        workers = first.get("workers", {})
        walls = [w["wall_s"] for w in workers.values()] or [1.0]
        lost = sorted({w for s in self.summaries for w in s["lost_workers"]})
        back = sorted({w for s in self.summaries for w in s.get("readmitted_workers", [])})
        return {
            "servers": self.servers,
            "workers": self.role.workers,
            "parameter_bytes": self.flat.numel() * 4,
            "lost_workers": lost,
            "readmitted_workers": back,
            "job_samples_per_s": sum(w["samples"] for w in workers.values()) / max(walls),
            "staleness_histogram": first.get("server", {}).get("staleness", {}),
            "server_stats": [s["server"] for s in self.summaries],
            "worker_cpu_s": [workers[w].get("cpu_s", 0.0) for w in sorted(workers, key=int)],
        }


class _PSMixin:
    _ps: PSWorker

    def step(self, closure: Callable[[], float] | None = None) -> Any:
        if closure is not None:
            with torch.enable_grad():
                closure()
        self._ps.step()
        return None


def PSOptimizer(optimizer: Optimizer, worker: PSWorker) -> Optimizer:  # noqa: N802
    """`optimizer` whose step pushes to and pulls from the servers of `worker`."""
    return wrap_optimizer(optimizer, _PSMixin, _ps=worker)
