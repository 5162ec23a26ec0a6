"""The cluster bench's table, verdicts and plot."""

from pathlib import Path

from weightbus.apps.bench.cluster.common import Row
from weightbus.apps.bench.cluster.experts import PATHS as EXPERT_PATHS
from weightbus.apps.bench.cluster.experts import speedups
from weightbus.apps.tables import print_table
from weightbus.core.units import format_bytes

TARGET_OF_LINKS = (
    0.8  # senders: aggregate >= 0.8 x T x link while the engines' links are not the bound
)
TARGET_PLAN_ERROR = 0.2  # the planner within 20% of the measured time
TARGET_DELTA_SPEEDUP = 5.0  # deltas: lr 1e-6, whole push time over delta push time
TARGET_EXPERT_SPEEDUP = 1.6  # experts: EP 2, every byte to every rank over each expert to its rank
TARGET_EXPERT_PLAN_ERROR = 0.1  # experts: the planner within 10% of measured bytes and times


def print_rows(title: str, rows: list[Row]) -> None:
    print(f"\n{title}")
    headers = [
        "path",
        "T",
        "E/R",
        "median s",
        "GB/s",
        "link bound GB/s",
        "of bound",
        "planned s",
        "error",
        "planned bound",
        "bytes per trainer rank",
    ]
    table = [
        [
            row.path,
            row.trainer_hosts,
            row.engine_hosts,
            f"{row.median_s:.3f}",
            f"{row.gb_per_s:.4f}",
            f"{row.link_bound_gb_per_s:.4f}",
            f"{row.gb_per_s / row.link_bound_gb_per_s:.2f}",
            f"{row.predicted_s:.3f}",
            f"{plan_error(row):+.0%}",
            row.predicted_bottleneck,
            " / ".join(format_bytes(n) for n in row.sent_bytes[:4]),
        ]
        for row in rows
    ]
    print_table(headers, table)


def print_experts(rows: list[Row]) -> None:
    """The experts case's bytes: into the engine's NIC and per engine rank, measured beside
    `weightbus plan`'s."""
    headers = [
        "path",
        "engine",
        "engine NIC in",
        "planned",
        "error",
        "bytes per engine rank",
        "planned per rank",
        "error",
    ]
    table = []
    for row in rows:
        layout = EXPERT_PATHS[row.path][0]
        received = row.host_bytes["engine0"][1]
        measured = row.engine_rank_bytes[0]
        table.append([
            row.path,
            f"TP {layout.tp}, EP {layout.ep}" if layout.ep > 1 else f"TP {layout.tp}",
            format_bytes(received),
            format_bytes(row.predicted_engine_nic_bytes),
            f"{(row.predicted_engine_nic_bytes - received) / received:+.1%}",
            " / ".join(format_bytes(n) for n in measured),
            " / ".join(format_bytes(n) for n in row.predicted_rank_bytes),
            f"{rank_bytes_error(row):+.2%}",
        ])  # fmt: skip
    print_table(headers, table)
    for routed, whole, ratio in speedups(rows):
        print(f"{routed} vs {whole}: {ratio:.2f}x faster")


def rank_bytes_error(row: Row) -> float:
    """The planner's bytes per engine rank against those the ranks counted: the largest
    relative error over the ranks."""
    pairs = zip(row.predicted_rank_bytes, row.engine_rank_bytes[0], strict=True)
    return max(((planned - got) / got for planned, got in pairs), key=abs)


def plan_error(row: Row) -> float:
    return (row.predicted_s - row.median_s) / row.median_s


def verdicts(rows: list[Row]) -> list[str]:
    """One line per target: met or not, with the figure."""
    lines = []
    for row in rows:
        if row.case == "senders" and row.trainer_hosts < row.engine_hosts:
            share = row.gb_per_s / row.link_bound_gb_per_s
            lines.append(
                _verdict(
                    f"senders {row.path} T={row.trainer_hosts} E={row.engine_hosts}: "
                    f"{share:.2f} x T x link",
                    share >= TARGET_OF_LINKS,
                    f">= {TARGET_OF_LINKS}",
                )
            )
        target = TARGET_EXPERT_PLAN_ERROR if row.case == "experts" else TARGET_PLAN_ERROR
        lines.append(
            _verdict(
                f"plan {row.case} {row.path} T={row.trainer_hosts} E/R={row.engine_hosts}: "
                f"{plan_error(row):+.0%}",
                abs(plan_error(row)) <= target,
                f"within {target:.0%}",
            )
        )
        if row.case == "experts":
            lines.append(
                _verdict(
                    f"plan experts {row.path} bytes per engine rank: {rank_bytes_error(row):+.2%}",
                    abs(rank_bytes_error(row)) <= TARGET_EXPERT_PLAN_ERROR,
                    f"within {TARGET_EXPERT_PLAN_ERROR:.0%}",
                )
            )
    for routed, whole, ratio in speedups(rows):
        lines.append(
            _verdict(
                f"experts {routed} vs {whole}: {ratio:.2f}x faster",
                ratio >= TARGET_EXPERT_SPEEDUP,
                f">= {TARGET_EXPERT_SPEEDUP}x",
            )
        )
    deltas = {row.path: row for row in rows if row.case == "deltas"}
    for name in sorted({path.rsplit(": ", 1)[0] for path in deltas}):
        speedup = deltas[f"{name}: whole"].median_s / deltas[f"{name}: delta"].median_s
        target = TARGET_DELTA_SPEEDUP if name.endswith(", lr 1e-6") else 0.0
        lines.append(
            _verdict(
                f"deltas {name}: {speedup:.1f}x faster than whole",
                speedup >= target,
                f">= {target}x" if target else "no target",
            )
        )
    return lines


def _verdict(text: str, met: bool, target: str) -> str:
    return f"{text} (target {target}: {'met' if met else 'NOT met'})"


def plot(rows: list[Row], path: str | Path) -> None:
    """Throughput against T (senders) and R (replicas): measured, predicted, the link bound.

    Raises:
        ImportError: matplotlib is missing (`pip install weightbus[bench]`).
    """
    import matplotlib as mpl

    mpl.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(14, 5))
    _panel(
        axes[0],
        [r for r in rows if r.case == "senders"],
        "trainer_hosts",
        "engine_hosts",
        "trainer hosts T (E engine replicas)",
    )
    _panel(
        axes[1],
        [r for r in rows if r.case == "replicas"],
        "engine_hosts",
        None,
        "replicas R (TP 2, one host each)",
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _panel(axis, rows: list[Row], x_field: str, group_field: str | None, label: str) -> None:
    series: dict[str, list[Row]] = {}
    for row in rows:
        key = row.path if group_field is None else f"{row.path}, E={getattr(row, group_field)}"
        series.setdefault(key, []).append(row)
    for key, members in series.items():
        xs = [getattr(r, x_field) for r in members]
        (line,) = axis.plot(xs, [r.gb_per_s for r in members], marker="o", label=f"{key} measured")
        predicted = [r.delivered_bytes / r.predicted_s / 1e9 for r in members]
        axis.plot(xs, predicted, linestyle="--", color=line.get_color(), label=f"{key} planned")
    if rows:
        xs = sorted({getattr(r, x_field) for r in rows})
        bound = {getattr(r, x_field): r.link_bound_gb_per_s for r in rows}
        axis.plot(xs, [bound[x] for x in xs], color="#999999", linestyle=":", label="link bound")
    axis.set_xlabel(label)
    axis.set_ylabel("GB/s delivered to the engines")
    axis.legend(fontsize="x-small")
