"""The comparison's PNG: update time per case, and time against size when several were run."""

from pathlib import Path

COLORS = {"floor": "#999999", "weightbus": "#1f77b4"}
BASELINE_COLOR = "#d62728"


def plot_results(results: list[dict], path: str | Path) -> None:
    """Bar chart of median update seconds (largest size); a scaling curve beside it if several.

    Raises:
        ImportError: matplotlib is missing (`pip install weightbus[bench]`).
    """
    import matplotlib as mpl

    mpl.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    largest = max(results, key=lambda r: r["size"])
    scaling = len(results) > 1
    fig, axes = plt.subplots(1, 2 if scaling else 1, figsize=(14 if scaling else 8, 5))
    bars = axes[0] if scaling else axes
    rows = largest["rows"]
    bars.barh(
        [row["name"] for row in rows],
        [row["median_s"] for row in rows],
        color=[COLORS.get(row["kind"], BASELINE_COLOR) for row in rows],
    )
    bars.invert_yaxis()
    bars.set_xlabel("update time, seconds (median)")
    bars.set_title(f"{largest['size'] / 2**30:.2f} GiB of bf16 weights")
    if scaling:
        _plot_scaling(axes[1], results)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_scaling(axis, results: list[dict]) -> None:
    ordered = sorted(results, key=lambda r: r["size"])
    sizes_gib = [r["size"] / 2**30 for r in ordered]
    for index, row in enumerate(ordered[0]["rows"]):
        seconds = [r["rows"][index]["median_s"] for r in ordered]
        axis.plot(sizes_gib, seconds, marker="o", label=row["name"])
    axis.set_xscale("log")
    axis.set_yscale("log")
    axis.set_xlabel("model size, GiB")
    axis.set_ylabel("update time, seconds (median)")
    axis.legend(fontsize="small")
