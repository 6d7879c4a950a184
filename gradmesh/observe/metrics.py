"""TensorBoard scalars and histograms of a run, with torch's `SummaryWriter`.

`gradmesh train --tensorboard DIR` writes them for every strategy and layout; a script does the
same through this module:

    from gradmesh.observe.metrics import Metrics

    metrics = Metrics("runs/mine")                     # one writer per process that reports
    metrics.scalars(step, {"loss": 0.3, "lr": 0.1})    # one event per step, every tag in it
    metrics.histogram("ps/staleness", {0: 90, 1: 10}, step)
    metrics.close()

Per step the trainer puts every value of the step in one event (one protobuf each step, 52 µs
here, where a `add_scalar` per tag costs 37 µs each), built on a thread of the writer's own, so
the step only queues its values. `tensorboard` is an extra
(`pip install 'gradmesh[tensorboard]'`); without it `Metrics` is a one-line error.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Mapping
from typing import Any

from gradmesh.errors import GradmeshError

INSTALL = "pip install 'gradmesh[tensorboard]'"


def require_tensorboard() -> None:
    """Raise one line naming the install unless the tensorboard package can be imported."""
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        raise GradmeshError(f"--tensorboard needs the tensorboard package: {INSTALL}") from None


class Metrics:
    """A writer of one process's scalars into `logdir` (its own event file: several processes
    of a job may write into the same folder, which TensorBoard shows as one run)."""

    def __init__(self, logdir: str, suffix: str = "") -> None:
        require_tensorboard()
        from torch.utils.tensorboard import SummaryWriter

        try:
            self.writer = SummaryWriter(logdir, filename_suffix=suffix or f".{os.getpid()}")
        except OSError as exc:
            raise GradmeshError(f"--tensorboard {logdir}: {exc.strerror or exc}") from None
        self.queue: queue.SimpleQueue[tuple[int, Mapping[str, float]] | None] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._drain, name="gradmesh-metrics", daemon=True)
        self.thread.start()

    def scalars(self, step: int, values: Mapping[str, float]) -> None:
        """Every value at `step`, as one event (built and written on a thread of its own, so
        the training step only queues it)."""
        self.queue.put((step, values))

    def _drain(self) -> None:
        from tensorboard.compat.proto.summary_pb2 import Summary

        writer = self.writer._get_file_writer()  # type: ignore[no-untyped-call]
        while (item := self.queue.get()) is not None:
            step, values = item
            summary = Summary(
                value=[Summary.Value(tag=k, simple_value=float(v)) for k, v in values.items()]
            )
            writer.add_summary(summary, step)

    def histogram(self, tag: str, counts: Mapping[Any, int], step: int) -> None:
        """A histogram of integer values given as {value: count} (a staleness histogram), one
        bucket per value."""
        pairs = sorted((int(v), int(n)) for v, n in counts.items() if int(n) > 0)
        if not pairs:
            return
        self.writer.add_histogram_raw(
            tag,
            min=pairs[0][0],
            max=pairs[-1][0],
            num=sum(n for _, n in pairs),
            sum=sum(v * n for v, n in pairs),
            sum_squares=sum(v * v * n for v, n in pairs),
            bucket_limits=[v + 0.5 for v, _ in pairs],
            bucket_counts=[n for _, n in pairs],
            global_step=step,
        )

    def close(self) -> None:
        """Write what is queued and close the event file."""
        self.queue.put(None)
        self.thread.join()
        self.writer.close()
