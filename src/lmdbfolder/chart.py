"""The PNG chart of ``lmdbfolder bench`` (matplotlib, an optional dependency)."""

from __future__ import annotations

from typing import Any

__all__ = ["write_chart", "chart_available"]


def chart_available() -> bool:
    """Whether matplotlib is installed."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def write_chart(result: Any, path: str) -> None:
    """Draw a ``BenchResult`` as a PNG at ``path``: raw-read MB/s (cold and
    warm) on the left, training-pipeline images/s against worker count on the
    right. Raises ImportError when matplotlib is missing."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ms = result.measurements
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5.2))
    caches = [c for c in ("cold", "warm") if any(m.workload == f"raw read, {c}" for m in ms)]
    names: list[str] = []
    for m in ms:
        if m.workload.startswith("raw read") and m.contestant not in names:
            names.append(m.contestant)
    width = 0.8 / max(1, len(names))
    for k, name in enumerate(names):
        values = []
        for c in caches:
            hit = [m for m in ms if m.workload == f"raw read, {c}" and m.contestant == name]
            values.append(hit[0].mb_per_second if hit else 0.0)
        xs = [i + k * width for i in range(len(caches))]
        bars = left.bar(xs, values, width, label=name)
        left.bar_label(bars, fmt="%.0f", fontsize=7)
    left.set_xticks([i + width * (len(names) - 1) / 2 for i in range(len(caches))])
    left.set_xticklabels([f"page cache {c}" for c in caches])
    left.set_ylabel("MB/s (higher is better)")
    left.set_title("Raw read, random order (bytes only)")
    left.legend(fontsize=8)

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
    right.set_title(f"Training pipeline: RandomResizedCrop({result.config['size']}) + flip + to tensor")
    right.legend(fontsize=8)
    right.grid(alpha=0.3)
    fig.suptitle(f"lmdbfolder bench: {result.images:,} images, {result.machine.get('cpus')} CPUs", fontsize=11)
    fig.text(0.5, 0.005, "Recommendation: " + result.recommendation, ha="center", fontsize=8, wrap=True)
    fig.tight_layout(rect=(0, 0.05, 1, 0.96))
    fig.savefig(path, dpi=110)
    plt.close(fig)
