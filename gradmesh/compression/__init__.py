"""Gradient compression: one set of stateful compressors, with error feedback, for every path
(allreduce with any algorithm, the DDP hook, local SGD's averaging, the parameter server's push).

    compressor = make("topk", ratio=0.01)          # error feedback on: topk is biased
    state = compressor.new_state(bucket.numel())   # one per tensor, kept between calls
    reduce(bucket, compressor, state, Link(group, algorithm="ring"))   # summed in place

See docs/compression.md for each compressor's cost and when it helps.
"""

from typing import Any


def __getattr__(name: str) -> Any:  # loaded on first use: the options in `config` need no torch
    from gradmesh.compression import registry

    return getattr(registry, name)
