"""Named interconnects (`--intra-fabric`, `--inter-fabric`): a link's line rate, its latency, the
fraction of the line rate a collective's transfers reach, and each message's software overhead
(the library's and the driver's). The simulator prices a message of n bytes on a link at
alpha = latency + overhead and beta = 1 / (rate x fraction), through the collectives' own
cost formulas (`Links.allreduce_s`).

The rates are the standards' (per direction; NVLink and NVSwitch per GPU, summed over its
links); the latencies, fractions and overheads are typical published figures for each kind of
transport, assumed, not fitted (H100's: NCCL's ring reaches about 370 GB/s of NVLink 4's 450 a
direction, NVLS's in-switch reduction about 480 GB/s of allreduce bus bandwidth, and 400 Gbit/s
InfiniBand 46-49 GB/s a GPU): TCP pays the kernel's stack on every message, RDMA (RoCE,
InfiniBand) does not, and GPU-to-GPU links within a node are the fastest and the shortest.
Options given beside a fabric (`--inter-node-bandwidth`, `--latency`, ...) override its figures.
"""

from __future__ import annotations

from dataclasses import dataclass

from gradmesh.collectives.cost import CostParams
from gradmesh.registry import Registry


@dataclass(frozen=True)
class Fabric:
    gbit: float
    """Line rate, Gbit/s per direction."""
    latency_s: float
    fraction: float
    """Of the line rate, reached by large transfers."""
    overhead_s: float
    """Per message, on top of the latency."""
    what: str

    @property
    def alpha(self) -> float:
        return self.latency_s + self.overhead_s

    @property
    def beta(self) -> float:
        """Seconds a byte."""
        return 8 / (self.gbit * 1e9 * self.fraction)


FABRICS: Registry[Fabric] = Registry("fabric")
_US = 1e-6
for _name, _fabric in {
    "nvlink-p100": Fabric(640, 2 * _US, 0.8, 5 * _US, "NVLink 1: 4 links of 20 GB/s a GPU"),
    "nvlink-v100": Fabric(1200, 2 * _US, 0.8, 5 * _US, "NVLink 2: 6 links of 25 GB/s a GPU"),
    "nvswitch-a100": Fabric(2400, 2 * _US, 0.8, 5 * _US, "NVLink 3 over NVSwitch, 300 GB/s"),
    "nvswitch-h100": Fabric(
        3600, 2 * _US, 370 / 450, 5 * _US, "NVLink 4 over NVSwitch, 450 GB/s; NCCL's ring 370"
    ),
    "nvls-h100": Fabric(
        3600,
        2 * _US,
        480 / 450,
        5 * _US,
        "NVLink 4 over NVSwitch with NVLS (the switch reduces): allreduce at 480 GB/s",
    ),  # fmt: skip
    "pcie3": Fabric(126, 5 * _US, 0.8, 5 * _US, "PCIe 3.0 x16, 15.75 GB/s"),
    "pcie4": Fabric(252, 5 * _US, 0.8, 5 * _US, "PCIe 4.0 x16, 31.5 GB/s"),
    "ethernet-10g": Fabric(10, 25 * _US, 0.8, 15 * _US, "TCP over 10 Gbit/s Ethernet"),
    "ethernet-25g": Fabric(25, 25 * _US, 0.8, 15 * _US, "TCP over 25 Gbit/s Ethernet"),
    "ethernet-50g": Fabric(50, 25 * _US, 0.8, 15 * _US, "TCP over 50 Gbit/s Ethernet"),
    "ethernet-100g": Fabric(100, 25 * _US, 0.7, 15 * _US, "TCP over 100 Gbit/s Ethernet"),
    "roce-25g": Fabric(25, 3 * _US, 0.9, 5 * _US, "RDMA over 25 Gbit/s Converged Ethernet"),
    "roce-100g": Fabric(100, 3 * _US, 0.9, 5 * _US, "RDMA over 100 Gbit/s Converged Ethernet"),
    "infiniband-edr": Fabric(100, 1 * _US, 0.9, 5 * _US, "InfiniBand EDR, 100 Gbit/s a port"),
    "infiniband-hdr": Fabric(200, 1 * _US, 0.9, 5 * _US, "InfiniBand HDR, 200 Gbit/s a port"),
    "infiniband-ndr": Fabric(
        400, 1 * _US, 47 / 50, 5 * _US, "InfiniBand NDR, 400 Gbit/s a port, 46-49 GB/s reached"
    ),
}.items():
    FABRICS.register(_name)(_fabric)


def fabric_terms(
    fabric: Fabric | None,
    links: int = 1,
    gbit: float | None = None,
    latency_s: float | None = None,
    default: tuple[float, float] = (100.0, 5e-6),
) -> CostParams:
    """Alpha-beta terms of `links` links of `fabric` side by side (a node's NICs), with the line
    rate and latency given beside it in their place; with no fabric, a bare link of `default`
    (Gbit/s, seconds) at its full rate and no overhead."""
    if fabric is None:
        rate, latency = gbit or default[0], latency_s if latency_s is not None else default[1]
        return CostParams(latency, 8 / (rate * 1e9 * links), 0.0)
    rate = gbit or fabric.gbit
    latency = latency_s if latency_s is not None else fabric.latency_s
    return CostParams(latency + fabric.overhead_s, 8 / (rate * 1e9 * fabric.fraction * links), 0.0)
