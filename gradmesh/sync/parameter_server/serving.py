"""A parameter server's settings (`ServerConfig`: its shard, its workers, and the job's ps
options, owned by `ParameterServerConfig`), where its checkpoints go, what it counts, and the
checks of a request that the wire format cannot make."""

from __future__ import annotations

import json
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from gradmesh.compression.registry import DECODERS
from gradmesh.options import from_mapping
from gradmesh.sync.config import ParameterServerConfig
from gradmesh.sync.parameter_server.protocol import Kind, Message, WireError

PUSHES = (Kind.PUSH, Kind.PUSH_PULL)
REQUESTS = {kind: (kind.name.lower(),) for kind in Kind} | {Kind.PUSH_PULL: ("push", "pull")}
"""What the server's stats count a message as: a push-and-pull is a push and a pull."""


@dataclass(frozen=True)
class ServerConfig:
    """One server of a ps job: its shard, its workers, the job's ps options, and the update's
    learning rate (a gradient's step, `gradient_lr`), momentum and weight decay."""

    index: int
    workers: int
    numel: int
    ps: ParameterServerConfig = field(default_factory=ParameterServerConfig)
    lr: float = 0.05
    momentum: float = 0.0
    weight_decay: float = 0.0
    timeout_s: float = 60.0

    @classmethod
    def of(cls, index: int, workers: int, numel: int, **options: Any) -> ServerConfig:
        """A server's settings: the job's ps options given whole (`ps=`) or by their flags'
        names (`mode="ssp"`, `max_staleness=2`, `server_optimizer="adam"`; `optimizer=` too,
        as scripts wrote it), and `lr`, `momentum`, `weight_decay`, `timeout_s`."""
        names = ("lr", "momentum", "weight_decay", "timeout_s")
        own = {k: options.pop(k) for k in names if k in options}
        if "optimizer" in options:
            options["server_optimizer"] = options.pop("optimizer")
        base = options.pop("ps", None) or ParameterServerConfig()
        ps = from_mapping(ParameterServerConfig, options, "parameter server options", base)
        return cls(index, workers, numel, ps, **own)


class Restorable(Protocol):
    """What restoring a checkpoint needs of a server: its settings, state and version."""

    cfg: ServerConfig
    version: int

    def load_state_dict(self, saved: dict[str, Any]) -> None: ...


class ShardCheckpoints(Protocol):
    """Where a server's part of each checkpoint goes (the trainer's checkpoint folder)."""

    def save(self, index: int, step: int, state: dict[str, Any]) -> None:
        """Write server `index`'s `state_dict()` as its part of the checkpoint after `step`."""

    def restore(self, server: Restorable) -> None:
        """Load the newest complete checkpoint's part of `server` into it, if there is one."""


class Progress:
    """Server 0's live bar on a terminal: updates applied, push and pull rates, and the
    staleness of the gradients applied so far (its mean and largest)."""

    def __init__(self, stats: ServerStats) -> None:
        from tqdm import tqdm

        self.stats = stats
        self.bar = tqdm(unit="update", dynamic_ncols=True, leave=False, desc="ps server 0")
        self.shown = 0.0

    def update(self) -> None:
        self.bar.update(1)
        now = time.monotonic()
        if now - self.shown < 0.5:
            return
        self.shown = now
        span = max(self.stats.last - self.stats.first, 1e-9)
        counts = Counter[int]()
        for per_worker in self.stats.staleness.values():
            counts.update(per_worker)
        applied = sum(counts.values())
        self.bar.set_postfix(
            push_s=f"{self.stats.requests['push'] / span:.0f}",
            pull_s=f"{self.stats.requests['pull'] / span:.0f}",
            staleness=f"mean {sum(k * n for k, n in counts.items()) / max(applied, 1):.2f} "
            f"max {max(counts, default=0)}",
            refresh=False,
        )

    def close(self) -> None:
        self.bar.close()


@dataclass
class ServerStats:
    requests: Counter[str] = field(default_factory=Counter)
    bytes_in: int = 0
    bytes_out: int = 0
    dropped: int = 0
    decoded: int = 0
    depth_max: int = 0
    depth_sum: int = 0
    wakeups: int = 0
    first: float = 0.0
    last: float = 0.0
    cpu_first: float = 0.0
    cpu_last: float = 0.0
    """The process's CPU time at the first and the last message (serving, not starting)."""
    staleness: dict[int, Counter[int]] = field(default_factory=dict)

    def as_dict(self, index: int, lost: list[int]) -> dict[str, Any]:
        span = max(self.last - self.first, 1e-9)
        total = sum(self.requests.values())
        return {
            "server": index,
            "requests": dict(self.requests),
            "request_rate": total / span,
            "bytes_in": self.bytes_in,
            "bytes_out": self.bytes_out,
            "dropped_messages": self.dropped,
            "decompressed_pushes": self.decoded,
            "queue_depth_max": self.depth_max,
            "queue_depth_mean": self.depth_sum / max(self.wakeups, 1),
            "staleness": {
                str(w): {str(k): v for k, v in sorted(h.items())}
                for w, h in sorted(self.staleness.items())
            },
            "lost_workers": lost,
            "cpu_s": self.cpu_last - self.cpu_first,
        }


def decompress(msg: Message, numel: int) -> torch.Tensor:
    """The dense shard a compressed push stands for; WireError if it does not parse."""
    decoder = DECODERS.get(msg.codec)
    if decoder is None or msg.payload is None:
        raise WireError(f"unknown codec {msg.codec}")
    dense = torch.zeros(numel, device="cpu")
    try:
        decoder.decode(msg.payload, msg.ctx, dense)
    except (ValueError, RuntimeError) as exc:
        raise WireError(f"codec {decoder.name}: {exc}") from None
    return dense


def check_request(
    msg: Message, cfg: ServerConfig, initialized: bool, saves: Any, version: int
) -> Message:
    """What decode cannot know: worker index, shard size, dtype (of a compressed push's decoded
    shard), a JSON payload's text, whether this server keeps checkpoints (`saves`) at this
    version."""
    if not 0 <= msg.worker < cfg.workers:
        raise WireError(f"no worker {msg.worker}")
    if msg.kind in (Kind.INIT, *PUSHES):
        p = msg.payload
        if p is None or p.dtype != torch.float32 or p.numel() != cfg.numel:
            raise WireError("a shard of the wrong size or dtype")
        if msg.kind in PUSHES and not initialized:
            raise WireError("push before init")
    elif msg.kind is Kind.FINISH:
        try:
            json.loads(bytes(msg.raw or b"{}"))
        except (ValueError, UnicodeDecodeError):
            raise WireError("finish stats are not JSON") from None
    elif msg.kind is Kind.SAVE:
        if saves is None or cfg.ps.mode != "sync":
            raise WireError("this server keeps no checkpoints")
        if msg.clock != version:
            raise WireError(f"SAVE of step {msg.clock} at version {version}")
    elif msg.kind not in (Kind.PULL, Kind.CLOSE):
        raise WireError(f"a server does not take {msg.kind.name}")
    return msg
