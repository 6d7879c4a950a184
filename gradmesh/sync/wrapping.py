"""Wrap an optimizer the way Horovod does: an instance of a new subclass of its own class that
shares its parameter groups and state, with extra methods mixed in. LR schedulers, `isinstance`
and `state_dict` keep working. Used by every strategy that changes what `step()` does."""

from __future__ import annotations

from typing import Any, cast

from torch.optim import Optimizer


def wrap_optimizer(optimizer: Optimizer, mixin: type, **attributes: Any) -> Optimizer:
    """A `mixin`-first subclass instance of `optimizer`'s class, sharing its state."""
    cls = type(optimizer.__class__.__name__, (mixin, optimizer.__class__), {})
    wrapped = cast(Optimizer, object.__new__(cls))
    wrapped.__dict__.update(optimizer.__dict__)
    for name, value in attributes.items():
        setattr(wrapped, name, value)
    return wrapped
