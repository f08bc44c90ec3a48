"""The bench's results: `bench.json` (every run's figures and the ratios), a Markdown table, and a PNG with one
recovery timeline per system."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

PEERS = ("job_restart", "nvrx", "torchft")
MARKS = (  # (key in a run's "marks", label, colour)
    ("detected", "detected", "tab:orange"),
    ("processes_started", "processes started", "tab:purple"),
    ("state_restored", "state restored", "tab:blue"),
    ("training_resumed", "training loop entered", "tab:cyan"),
    ("first_step_after", "first step after", "tab:green"),
)


def _median(values: list[float]) -> float | None:
    return round(statistics.median(values), 3) if values else None


def _spread(values: list[float]) -> list[float] | None:
    return [round(min(values), 3), round(max(values), 3)] if values else None


def summarize(system: str, faulted: list[dict[str, Any]], clean: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over a system's runs: downtime, job time lost (each faulted run's training span minus the median of
    the fault-free runs', `systems.measure`; the same with wall times, launcher start to exit, as `lost_wall_s`),
    steps lost and skipped, whether every faulted run ended equal to the fault-free state."""
    ok = [r for r in faulted if not r["problems"]]
    clean_ok = [r for r in clean if not r["problems"]]
    ff_wall = _median([r["wall_s"] for r in clean_ok])
    ff_span = _median([r["span_s"] for r in clean_ok if r.get("span_s") is not None])
    downtimes = [r["downtime_s"] for r in ok if r.get("downtime_s") is not None]
    lost = [round(r["span_s"] - ff_span, 3) for r in ok if r.get("span_s") is not None] if ff_span is not None else []
    lost_wall = [round(r["wall_s"] - ff_wall, 3) for r in ok] if ff_wall is not None else []
    reference = {r["params_sha256"] for r in clean_ok}
    out: dict[str, Any] = {
        "runs": len(faulted), "runs_ok": len(ok),
        "downtime_s": _median(downtimes), "downtime_range_s": _spread(downtimes),
        "lost_s": _median(lost), "lost_range_s": _spread(lost), "lost_wall_s": _median(lost_wall),
        "fault_free_wall_s": ff_wall, "fault_free_span_s": ff_span,
        "fault_free_steps_per_s": _median([r["steps_per_s"] for r in clean_ok if r.get("steps_per_s")]),
        "steps_lost": _median([r["steps_lost"] for r in ok if r.get("steps_lost") is not None]),
        "steps_skipped": _median([r["steps_skipped_by_rank1"] for r in ok if "steps_skipped_by_rank1" in r]),
        "equal_to_fault_free": (all(r["params_sha256"] in reference for r in ok) if ok and len(reference) == 1
                                else None),
        "problems": sorted({p for r in [*faulted, *clean] for p in r["problems"]}),
    }
    return out


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or denominator is None or denominator <= 0:
        return None
    return round(numerator / denominator, 2)


def table(results: dict[str, Any]) -> str:
    """A Markdown table of the systems, then our own costs."""
    head = ("| system | downtime (range) | job time lost (range) | steps lost | steps skipped | ends equal | "
            "fault-free steps/s |\n|---|---|---|---|---|---|---|")
    rows = [head]
    for name, s in results["systems"].items():
        if "why" in s:
            rows.append(f"| {name} | {s['why']} | | | | | |")
            continue

        def fig(key: str, s: dict[str, Any] = s) -> str:
            value, spread = s.get(key), s.get(key.replace("_s", "_range_s"))
            if value is None:
                return "n/a"
            return f"{value:.2f} s" + (f" ({spread[0]:.2f}-{spread[1]:.2f})" if spread and spread[0] != spread[1]
                                       else "")

        equal = {True: "yes", False: "no", None: "n/a"}[s.get("equal_to_fault_free")]
        problems = f" ({'; '.join(s['problems'])})" if s.get("problems") else ""
        rows.append(f"| {name}{problems} | {fig('downtime_s')} | {fig('lost_s')} | {s.get('steps_lost')} | "
                    f"{s.get('steps_skipped')} | {equal} | {s.get('fault_free_steps_per_s')} |")
    ratios = results["ratios"]
    rows.append("")
    rows.append("| figure | value | goal |\n|---|---|---|")
    goals = {"rto_ratio_vs_job_restart": ">= 30", "rto_ratio_vs_nvrx": ">= 20", "rto_ratio_vs_torchft": ">= 10",
             "lost_ratio_vs_job_restart": ">= 30", "lost_ratio_vs_nvrx": ">= 20", "lost_ratio_vs_torchft": ">= 10",
             "overhead_pct": "<= 1", "memory_overhead_ratio": "<= 1.05", "transfer_efficiency": ">= 0.8",
             "rto_scaling_8_over_2": "<= 1.2"}
    for key, goal in goals.items():
        rows.append(f"| `{key}` | {ratios.get(key)} | {goal} |")
    return "\n".join(rows) + "\n"


def _pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend (files only), or None when matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _panel(ax: Any, points: list[tuple[float, int]], marks: dict[str, float], downtime: float | None,
           lo: float, hi: float, title: str) -> None:
    """One recovery: steps completed (x: seconds since the fault), the fault, the marks, the downtime."""
    if points:
        ax.plot([p[0] for p in points], [p[1] for p in points], ".", color="black", markersize=3,
                label="rank 0 step done")
    ax.axvline(0.0, color="tab:red", linewidth=2, label="fault")
    for key, label, colour in MARKS:
        if key in marks:
            ax.axvline(marks[key], color=colour, linestyle="--", label=label)
    if downtime is not None:
        ax.axvspan(0.0, downtime, color="tab:red", alpha=0.08)
        ax.axvline(downtime, color="black", linestyle=":", label="fault step done on every rank")
    ax.set_xlim(lo, hi)
    ax.set_ylabel("step")
    ax.set_title(title, fontsize=9, loc="left")
    ax.legend(fontsize=6, loc="upper left", ncol=4)


def timeline_png(results: dict[str, Any], runs: dict[str, list[dict[str, Any]]], path: Path) -> None:
    """One panel per system: rank 0's completed steps against wall time around the first fault, with the fault and
    the moments of the recovery that its logs show, on one time axis."""
    plt = _pyplot()
    if plt is None:
        print("checkpointless-bench: no timeline.png: matplotlib is not installed (pip install '.[bench]')")
        return
    shown: list[tuple[str, dict[str, Any]]] = []
    for name in results["systems"]:
        first = next((r for r in runs.get(name, []) if r.get("fault")), None)
        if first is not None:
            shown.append((name, first))
    if not shown:
        return
    lo = -2.0
    hi = max(max(r.get("downtime_s") or 0.0, *r.get("marks", {}).values(), 0.0) for _, r in shown) + 2.0
    fig, axes = plt.subplots(len(shown), 1, figsize=(10, 2.1 * len(shown)), squeeze=False, sharex=True)
    for ax, (name, run) in zip(axes[:, 0], shown, strict=True):
        fault_t = run["fault"]["t"]
        points = [(t - fault_t, s) for s, t in run["steps"] if lo <= t - fault_t <= hi]
        _panel(ax, points, run.get("marks", {}), run.get("downtime_s"), lo, hi,
               f"{name}: downtime {run.get('downtime_s')} s, steps lost {run.get('steps_lost')}")
    axes[-1, 0].set_xlabel("seconds since the fault")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_timeline_png(run_dir: Path, summary: dict[str, Any], path: Path, most: int = 4) -> bool:
    """`checkpointless-train run.timeline=true`: the run's steps over its wall time with every fault marked, then
    one panel per recovery (the first `most`), from `run_dir/steps.csv` and the summary. False without
    matplotlib."""
    import csv

    plt = _pyplot()
    if plt is None:
        return False
    with open(run_dir / "steps.csv") as f:
        steps = [(int(row["step"]), float(row["last_t"])) for row in csv.DictReader(f)]
    recoveries = [r for r in summary.get("recoveries", []) if r.get("fault_t") is not None][:most]
    fig, axes = plt.subplots(1 + len(recoveries), 1, figsize=(10, 2.2 * (1 + len(recoveries))), squeeze=False)
    t0 = steps[0][1] if steps else 0.0
    whole = axes[0, 0]
    whole.plot([t - t0 for _, t in steps], [s for s, _ in steps], ".", color="black", markersize=2)
    for r in recoveries:
        whole.axvline(r["fault_t"] - t0, color="tab:red", linewidth=1)
    whole.set_xlabel("seconds since the first step")
    whole.set_ylabel("step")
    whole.set_title(f"{run_dir.name}: {len(summary.get('recoveries', []))} recoveries, final step "
                    f"{summary.get('final_step')}", fontsize=9, loc="left")
    for ax, r in zip(axes[1:, 0], recoveries, strict=True):
        marks = {"detected": r.get("detect_s"), "state_restored": r.get("state_restored_s"),
                 "first_step_after": r.get("recover_s")}
        marks = {k: v for k, v in marks.items() if v is not None}
        down = r.get("back_at_fault_step_s")
        hi = max([down or 0.0, *marks.values()]) + 1.0
        points = [(t - r["fault_t"], s) for s, t in steps if -1.0 <= t - r["fault_t"] <= hi]
        _panel(ax, points, marks, down, -1.0, hi, f"{r.get('fault_kind')} of ranks {r.get('failed_ranks')} at step "
               f"{r.get('step')}: {r.get('path')}, steps lost {r.get('steps_lost')}")
    axes[-1, 0].set_xlabel("seconds" if not recoveries else "seconds since the fault")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
