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
        + (f"test accuracy {report.test_accuracy:.3f}" if report.test_accuracy is not None else "")
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


def timeline_plot(path: str, trace: dict[str, Any], steps: int = 3) -> None:
    """The last `steps` steps of a merged timeline (`--timeline`) as one row per process and
    thread, each span a bar coloured by its name: the overlap Perfetto shows, without a
    browser. A step starts at the first process's `forward` (or its first span's name)."""
    from gradmesh.observe.timeline import trace_processes

    processes = trace_processes(trace)
    if not processes:
        raise GradmeshError("the timeline has no spans to plot")
    first = next(iter(processes.values()))[1]
    marker = "forward" if any(e["name"] == "forward" for e in first) else first[0]["name"]
    starts = [e["ts"] for e in first if e["name"] == marker]
    begin = starts[-steps] if len(starts) >= steps else starts[0]
    end = max(e["ts"] + e["dur"] for _n, events in processes.values() for e in events)
    plt = _pyplot()
    # a span that overlaps an earlier one on its thread (an asynchronous reduce under
    # backward) goes to the first sub-row free at its start, as trace viewers nest them
    lanes: dict[tuple[int, int, int], list[dict[str, Any]]] = {}
    for pid, (_name, events) in processes.items():
        ends: dict[tuple[int, int], list[float]] = {}
        for e in events:
            if e["ts"] + e["dur"] < begin:
                continue
            free = ends.setdefault((pid, e["tid"]), [])
            lane = next((i for i, t in enumerate(free) if t <= e["ts"]), len(free))
            free[lane : lane + 1] = [e["ts"] + e["dur"]]
            lanes.setdefault((pid, e["tid"], lane), []).append(e)
    rows = sorted(lanes)
    fig, ax = plt.subplots(figsize=(11, 0.45 * len(rows) + 1.6))
    colours: dict[str, Any] = {}
    palette = plt.get_cmap("tab10")
    for y, row in enumerate(rows):
        for e in lanes[row]:
            colour = colours.setdefault(e["name"], palette(len(colours) % 10))
            start = (e["ts"] - begin) / 1e3
            ax.broken_barh([(start, e["dur"] / 1e3)], (y - 0.4, 0.8), color=colour)
    threads = {
        (e["pid"], e["tid"]): e["args"]["name"]
        for e in trace["traceEvents"]
        if e.get("ph") == "M" and e.get("name") == "thread_name"
    }
    labels = [
        f"{processes[p][0]}: {threads.get((p, t), f'thread {t}')}" if lane == 0 else ""
        for p, t, lane in rows
    ]
    ax.set_yticks(range(len(rows)), labels)
    ax.invert_yaxis()
    ax.set_xlim(0, (end - begin) / 1e3)
    ax.set_xlabel("ms (rank 0's clock)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colours.values()]
    ax.legend(
        handles,
        list(colours),
        ncol=min(len(colours), 8),
        loc="upper center",
        bbox_to_anchor=(0.5, -0.35 if len(rows) < 4 else -0.15),
        frameon=False,
    )
    ax.set_title(f"the last {min(steps, len(starts))} steps, every process and thread")
    _save(fig, path)
