"""Scaling plots: efficiency and communication overhead against workers, one line per strategy
(matplotlib, the `plot` extra; imported only when a plot is asked for)."""

from __future__ import annotations

from typing import Any

from gradmesh.errors import GradmeshError


def scaling_plot(
    path: str, title: str, results: dict[str, list[dict[str, Any]]], unit: str
) -> None:
    """Write a PNG of two panels, efficiency and overhead (ms) against `unit` (a row key)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise GradmeshError("--plot needs matplotlib: pip install 'gradmesh[plot]'") from None
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
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=100)
    except OSError as exc:
        raise GradmeshError(f"cannot write the plot {path}: {exc.strerror}") from None
    finally:
        plt.close(fig)
