"""What a rank has communicated: bytes and seconds by kind, counted by the collectives (the one
byte counter every path adds to) and read by reports."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CommStats:
    """What this rank has communicated: counted by the collectives, read by reports."""

    bytes_sent: int = 0
    """Bytes this rank put on the wire (exact for gradmesh's algorithms, modelled for native)."""
    comm_s: float = 0.0
    """Seconds spent waiting in communication calls."""
    calls: int = 0
    by_kind: dict[str, int] = field(default_factory=dict)
    """Bytes sent by what they were for: 'sync' (replicas agreeing: gradients, parameters),
    'tensor_parallel' (a split layer's activations), 'pipeline' (activations between stages),
    'metrics' (losses and accuracies)."""

    def add(self, nbytes: int, seconds: float, kind: str = "sync") -> None:
        self.bytes_sent += nbytes
        self.comm_s += seconds
        self.calls += 1
        self.by_kind[kind] = self.by_kind.get(kind, 0) + nbytes

    compressed: dict[str, list[int]] = field(default_factory=dict)
    """By kind: [bytes given to a compressor, bytes of the messages it sent for them]."""

    def add_compressed(self, kind: str, given: int, payload: int) -> None:
        totals = self.compressed.setdefault(kind, [0, 0])
        totals[0] += given
        totals[1] += payload
