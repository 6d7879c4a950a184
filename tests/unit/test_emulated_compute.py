"""Emulated compute: the sleep is one step's MS, split over the layers by their FLOPs, each
layer's backward share slept in two halves (input gradient, weight gradient) before that
layer's gradient exists (so buckets leave when they would on a device that slow)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from gradmesh.models.flops import layer_flops
from gradmesh.models.registry import MODELS
from gradmesh.train import emulated


def test_sleep_is_split_by_flops_and_precedes_each_gradient(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    torch.manual_seed(0)
    model = MODELS.get("cnn")((1, 8, 8), 10)
    x = torch.randn(32, 1, 8, 8)
    events: list[tuple[str, Any]] = []
    monkeypatch.setattr("gradmesh.train.emulated.time.sleep", lambda s: events.append(("sleep", s)))
    handles = emulated.emulate_compute(model, x[:1], 30.0)
    names = {id(p): n.split(".")[0] for n, p in model.named_parameters()}
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(  # type: ignore[no-untyped-call]
            lambda p: events.append(("grad", names[id(p)]))
        )

    model(x).sum().backward()

    layers = layer_flops(MODELS.get("cnn")((1, 8, 8), 10), x[:1])
    total = sum(la.fwd_flops + la.bwd_flops for la in layers)
    slept = [s for kind, s in events if kind == "sleep"]
    assert len(slept) == 3 * len(layers)  # each layer: once in forward, twice in backward
    assert sum(slept) == pytest.approx(0.030)
    forward = slept[: len(layers)]
    assert forward == pytest.approx([0.030 * la.fwd_flops / total for la in layers])
    # backward runs the layers in reverse; each layer's sleep comes before its own gradients
    order = [la.name for la in reversed(layers)]
    backward = events[len(layers) :]
    firsts = [next(i for i, e in enumerate(backward) if e == ("grad", n)) for n in order]
    assert firsts == sorted(firsts)
    for name, first in zip(order, firsts, strict=True):
        share = 0.030 * next(la.bwd_flops for la in layers if la.name == name) / total
        assert backward[:first].count(("sleep", pytest.approx(share / 2))) >= 2
    for h in handles:
        h.remove()
    events.clear()
    model(x).sum().backward()
    assert not [e for e in events if e[0] == "sleep"]
