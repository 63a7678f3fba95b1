"""The PNG chart of ``lmdbfolder bench`` (matplotlib, an optional dependency)."""

from __future__ import annotations

import os
from typing import Any

__all__ = ["write_chart", "chart_available", "chart_problem"]


def chart_available() -> bool:
    """Whether matplotlib is installed."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def chart_problem(path: str) -> str | None:
    """Why a chart cannot be written at ``path`` (None: it can, as far as can be told
    before drawing it): a missing or unwritable folder, a folder in its place, a file
    type matplotlib does not write. Checked before the bench measures, so that a
    typo does not cost the minutes of measuring."""
    from matplotlib.backend_bases import FigureCanvasBase

    full = os.path.abspath(os.path.expanduser(path))
    folder = os.path.dirname(full)
    kind = os.path.splitext(full)[1][1:].lower()
    types = FigureCanvasBase.get_supported_filetypes()
    if kind and kind not in types:
        return f"matplotlib cannot write a .{kind} file; name it .png (or {', '.join('.' + t for t in sorted(types))})"
    if not os.path.isdir(folder):
        return f"the folder {folder} does not exist; create it first"
    if os.path.isdir(full):
        return f"{full} is a folder; name a file"
    if not os.access(folder, os.W_OK | os.X_OK) or (os.path.exists(full) and not os.access(full, os.W_OK)):
        return f"{full} cannot be written here (permission denied)"
    return None


def write_chart(result: Any, path: str) -> None:
    """Draw a ``BenchResult`` as a PNG at ``path``: raw-read MB/s (cold and
    warm) on the left, training-pipeline images/s against worker count on the
    right. Raises ImportError when matplotlib is missing."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ms = result.measurements
    caches = [c for c in ("cold", "warm") if any(m.workload == f"raw read, {c}" for m in ms)]
    fig, axes = plt.subplots(
        1,
        len(caches) + 1,
        figsize=(7 + 4.5 * len(caches), 5.6),
        gridspec_kw={"width_ratios": [1] * len(caches) + [1.5]},
    )
    for ax, cache in zip(axes, caches):
        raw = [m for m in ms if m.workload == f"raw read, {cache}"]
        labels = [m.contestant for m in raw]
        values = [m.mb_per_second for m in raw]
        bars = ax.barh(labels, values, color=[f"C{k}" for k in range(len(raw))])
        ax.bar_label(bars, labels=[f"{v:,.0f}" for v in values], fontsize=8, padding=2)
        ax.invert_yaxis()
        ax.set_xlabel("MB/s (higher is better)")
        ax.set_title(f"Raw read, random order, page cache {cache}")
        ax.tick_params(axis="y", labelsize=8)
        ax.margins(x=0.2)
    right = axes[-1]

    pipeline = [m for m in ms if m.workload.startswith("train pipeline")]
    contestants: list[str] = []
    for m in pipeline:
        if m.contestant not in contestants:
            contestants.append(m.contestant)
    for name in contestants:
        warm = sorted(
            (m.workers, m.images_per_second) for m in pipeline if m.contestant == name and "warm" in m.workload
        )
        if warm:
            line = right.plot([w for w, _ in warm], [v for _, v in warm], marker="o", label=f"{name}, warm")[0]
            cold = [(m.workers, m.images_per_second) for m in pipeline if m.contestant == name and "cold" in m.workload]
            if cold:
                right.scatter(
                    [w for w, _ in cold],
                    [v for _, v in cold],
                    marker="x",
                    color=line.get_color(),
                    label=f"{name}, cold",
                )
    if pipeline:
        right.set_xticks(sorted({m.workers for m in pipeline}))
    right.set_xlabel("DataLoader workers")
    right.set_ylabel("images/s (higher is better)")
    right.set_title(f"Training pipeline: RandomResizedCrop({result.config['size']}), flip, to tensor")
    right.legend(fontsize=7, loc="best")
    right.grid(alpha=0.3)
    fig.suptitle(f"lmdbfolder bench: {result.images:,} images, {result.machine.get('cpus')} CPUs", fontsize=11)
    fig.text(0.5, 0.005, "Recommendation: " + result.recommendation, ha="center", fontsize=8, wrap=True)
    fig.tight_layout(rect=(0, 0.05, 1, 0.96))
    fig.savefig(path, dpi=110)
    plt.close(fig)
