"""Plots (matplotlib, the `plot` extra; imported only when a plot is asked for): scaling
efficiency and communication overhead against workers, one line per strategy; a finished run's
loss curve and per-rank step times."""

from __future__ import annotations

from typing import Any

from gradmesh.errors import GradmeshError


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise GradmeshError("--plot needs matplotlib: pip install 'gradmesh[plot]'") from None
    return plt


def _save(fig: Any, path: str) -> None:
    plt = _pyplot()
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=100)
    except OSError as exc:
        raise GradmeshError(f"cannot write the plot {path}: {exc.strerror}") from None
    finally:
        plt.close(fig)


def run_plot(path: str, report: Any) -> None:
    """A finished run (`RunReport`): its loss per epoch, and each rank's seconds per step in
    computation and in communication."""
    plt = _pyplot()
    fig, (loss, ranks) = plt.subplots(1, 2, figsize=(10, 4))
    epochs = range(1, len(report.loss_history) + 1)
    loss.plot(epochs, report.loss_history, marker="o")
    loss.set_xlabel("epoch")
    loss.set_ylabel("training loss (mean over the job)")
    loss.xaxis.get_major_locator().set_params(integer=True)
    loss.grid(True, alpha=0.3)
    steps = max(report.steps, 1)
    compute = [s / steps * 1e3 for s in report.per_rank["compute_s"]]
    comm = [s / steps * 1e3 for s in report.per_rank["comm_s"]]
    index = list(range(len(compute)))
    ranks.bar(index, compute, label="compute")
    ranks.bar(index, comm, bottom=compute, label="communication")
    ranks.set_xticks(index, [str(i) for i in index])
    ranks.set_xlabel("rank")
    ranks.set_ylabel("ms per step")
    ranks.legend()
    fig.suptitle(
        f"{report.model} on {report.dataset}, {report.strategy}, {report.workers} workers: "
        f"test accuracy {report.test_accuracy:.3f}"
    )
    _save(fig, path)


def scaling_plot(
    path: str, title: str, results: dict[str, list[dict[str, Any]]], unit: str
) -> None:
    """Write a PNG of two panels, efficiency and overhead (ms) against `unit` (a row key)."""
    plt = _pyplot()
    fig, (eff, over) = plt.subplots(1, 2, figsize=(10, 4))
    for strategy, rows in results.items():
        xs = [r[unit] for r in rows]
        eff.plot(xs, [r["efficiency"] * 100 for r in rows], marker="o", label=strategy)
        over.plot(xs, [r["overhead_s"] * 1e3 for r in rows], marker="o", label=strategy)
    counts = sorted({r[unit] for rows in results.values() for r in rows})
    for ax, label in ((eff, "scaling efficiency, %"), (over, "communication overhead, ms")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(counts, [str(n) for n in counts])
        ax.set_xlabel(unit)
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
    top = max(r["efficiency"] for rows in results.values() for r in rows)
    eff.set_ylim(0, max(105, top * 100 + 5))
    eff.legend()
    fig.suptitle(title)
    _save(fig, path)
