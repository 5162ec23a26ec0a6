"""The PNG of `weightbus bench serving`: tokens/s over time, one panel per run, pushes shaded,
the run without pushes' mean dashed on every panel."""

from pathlib import Path

BIN_S = 0.25


def _rate(run: dict) -> tuple[list[float], list[float]]:
    start_s, end_s = run["window"]
    num_bins = max(1, int((end_s - start_s) / BIN_S))
    counts = [0] * num_bins
    for log in run["logs"]:
        for t in log.token_times_s:
            index = int((t - start_s) / BIN_S)
            if 0 <= index < num_bins:
                counts[index] += 1
    return [i * BIN_S for i in range(num_bins)], [c / BIN_S for c in counts]


def plot_serving(runs: list[dict], path: str | Path) -> None:
    """Raises: ImportError: matplotlib is missing (`pip install weightbus[bench]`)."""
    import matplotlib as mpl

    mpl.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(runs), 1, figsize=(10, 2.2 * len(runs)), sharex=True, sharey=True)
    axes = axes if len(runs) > 1 else [axes]
    baseline_rate = runs[0]["figures"].tokens_per_s  # the run without pushes comes first
    for axis, run in zip(axes, runs, strict=True):
        times, rates = _rate(run)
        axis.plot(times, rates, color="#1f77b4", linewidth=1)
        axis.axhline(baseline_rate, color="grey", linestyle="--", linewidth=0.8)
        start_s = run["window"][0]
        for push in run["pushes"]:
            axis.axvspan(push.start_s - start_s, push.end_s - start_s, color="#d62728", alpha=0.25)
        axis.set_ylabel("tokens/s")
        axis.set_title(run["figures"].mode, fontsize=10, loc="left")
        axis.set_ylim(bottom=0)
    axes[-1].set_xlabel(
        f"seconds (bins of {BIN_S:g} s; pushes shaded; dashed: the run without pushes' mean)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
