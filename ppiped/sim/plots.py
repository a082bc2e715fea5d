"""PNG plots people look at: attainment vs load factor (PPipe Fig. 7), per-vGPU timelines (Fig. 12).

matplotlib is imported inside each function with the Agg backend, so importing the simulator
never needs a display or pays matplotlib's start-up cost.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_attainment(
    curves: Mapping[str, Sequence[tuple[float, float]]],
    path: str | Path,
    title: str = "",
    target: float = 0.99,
) -> Path:
    """One line per system: min-over-models SLO attainment against load factor."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.6))
    for name, pts in curves.items():
        pts = sorted(pts)
        ax.plot([p[0] for p in pts], [100 * p[1] for p in pts], marker="o", ms=3, label=name)
    ax.axhline(100 * target, color="grey", lw=0.8, ls="--")
    ax.set_xlabel("load factor (1.0 = PPipe plan throughput)")
    ax.set_ylabel("SLO attainment (%)")
    ax.set_ylim(max(0, ax.get_ylim()[0]), 100.5)
    if title:
        ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_timeline(
    batches: Sequence[tuple[str, float, float, int, int]],
    path: str | Path,
    models: Sequence[str] = (),
    window_us: tuple[float, float] | None = None,
    title: str = "",
) -> Path:
    """Busy intervals of each vGPU: ``(vgpu label, start µs, end µs, model index, batch size)``."""
    plt = _pyplot()
    if window_us is not None:
        lo, hi = window_us
        batches = [b for b in batches if b[2] > lo and b[1] < hi]
    labels = sorted({b[0] for b in batches})
    row = {lab: i for i, lab in enumerate(labels)}
    colours = plt.get_cmap("tab10")
    fig, ax = plt.subplots(figsize=(9, max(2.0, 0.18 * len(labels) + 1)))
    for lab, s, e, m, _bs in batches:
        ax.broken_barh([(s / 1e3, (e - s) / 1e3)], (row[lab] - 0.4, 0.8), facecolor=colours(m % 10),
                       edgecolor="white", linewidth=0.4)
    ax.set_yticks(range(len(labels)), labels, fontsize=6)
    ax.set_xlabel("time (ms)")
    if window_us is not None:
        ax.set_xlim(window_us[0] / 1e3, window_us[1] / 1e3)
    if models:
        from matplotlib.patches import Patch

        ax.legend(handles=[Patch(color=colours(i % 10), label=n) for i, n in enumerate(models)],
                  fontsize=7, loc="upper right")
    if title:
        ax.set_title(title, fontsize=9)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_max_load(
    table: Mapping[str, Mapping[str, Sequence[float]]],
    configs: Sequence[str],
    path: str | Path,
    title: str = "",
) -> Path:
    """PPipe Figure 6: max load factor at the attainment target, one bar per system and config.

    ``table[panel][system]`` holds one value per entry of ``configs`` (NaN: not run); one panel
    per trace (e.g. Poisson, bursty), each with the per-system mean in the legend.
    """
    import math

    plt = _pyplot()
    panels = list(table)
    fig, axes = plt.subplots(len(panels), 1, figsize=(max(8.0, 0.28 * len(configs) + 2), 5.2 * len(panels)),
                             squeeze=False)
    colours = plt.get_cmap("tab10")
    for ax, panel in zip(axes[:, 0], panels, strict=True):
        systems = list(table[panel])
        w = 0.8 / max(1, len(systems))
        for i, name in enumerate(systems):
            vals = [float(v) for v in table[panel][name]]
            ok = [v for v in vals if not math.isnan(v)]
            mean = sum(ok) / len(ok) if ok else float("nan")
            xs = [j + (i - (len(systems) - 1) / 2) * w for j in range(len(vals))]
            ax.bar(xs, vals, width=w, color=colours(i % 10), label=f"{name} (mean {mean:.3f})")
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        ax.set_ylim(0, 1.3)
        ax.set_ylabel("max load factor")
        ax.set_title(panel, fontsize=9)
        ax.set_xlim(-0.6, len(configs) - 0.4)
        ax.set_xticks(range(len(configs)), [c for c in configs], rotation=90, fontsize=5)
        ax.legend(fontsize=8, ncol=len(systems), loc="upper center")
        ax.grid(axis="y", alpha=0.3)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
