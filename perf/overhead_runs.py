"""The ensemble's cost over bare vLLM across several runs of perf/overhead.py.

One run's interval holds only the noise between its rounds; runs of the same
code on the same machine kind have differed by more than that (docs/performance.md,
Serving overhead), because part of the cost is set by something that lasts a
whole run (each starts its own server and engine). This reads the per-round
medians the runs saved (overhead.json) and bootstraps on two levels, runs and
then rounds within each run, so its interval holds the run-to-run spread too.
Each run weighs the same, however many rounds it had.

    make overhead-runs    # the committed AMD EPYC runs with EngineCore sleeping -> perf/results/overhead/runs/
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import numpy as np


from overhead import (BARE, ENSEMBLE, GOAL_CONCURRENCY, GOALS, Goal, bootstrap_mean,
                      goal_verdicts, interval_text, percent_changes)
from a3b_backend.profiles import PROJECT_ROOT

RESULTS = PROJECT_ROOT / "perf" / "results" / "overhead"


def round_changes(rows: list[dict], per_round: str, concurrency: int) -> np.ndarray:
    """Each round's change of the ensemble against bare vLLM, in %, from one run's overhead.json rows."""
    def rounds_of(variant) -> list[float]:
        return next(r[per_round] for r in rows if r["variant"] == variant.name and r["concurrency"] == concurrency)

    return percent_changes(rounds_of(ENSEMBLE), rounds_of(BARE))


def two_level_percent(runs: list[np.ndarray], resamples: int = 10000) -> dict[str, float]:
    """Mean over runs of each run's mean change, with a 95% interval from
    resampling runs and then each picked run's rounds."""
    rng = np.random.default_rng(0)
    # resampled_means[k, i, j]: run k's rounds resampled, for slot j of resample i
    resampled_means = np.stack([
        run[rng.integers(0, len(run), (resamples, len(runs), len(run)))].mean(axis=2) for run in runs])
    picked = rng.integers(0, len(runs), (resamples, len(runs)))
    estimates = resampled_means[picked, np.arange(resamples)[:, None], np.arange(len(runs))].mean(axis=1)
    return {"mean": float(np.mean([run.mean() for run in runs])), "low": float(np.percentile(estimates, 2.5)),
            "high": float(np.percentile(estimates, 97.5))}


def machine_of(run: Path) -> str:
    report = run / "overhead.md"
    found = re.search(r"Machine: (.*?)\. Command", report.read_text())
    if not found:
        raise ValueError(f"{report} names no machine ('Machine: ... . Command'), so its run cannot be pooled")
    return found.group(1)


def measure_key(goal: Goal, concurrency: int) -> str:
    """Where a run's summary and the pooled result keep one goal's interval at one concurrency."""
    return f"{goal.measure}@{concurrency}"


def plot(per_run: dict[str, dict], pooled: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(goal, c) for goal in GOALS for c in GOAL_CONCURRENCY]
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 0.5 * len(per_run) + 2.5), sharey=True)
    labels = [*per_run, "all runs"]
    for ax, (goal, c) in zip(axes, panels):
        key = measure_key(goal, c)
        for y, change in enumerate([*(run[key] for run in per_run.values()), pooled[key]]):
            ax.errorbar(change["mean"], y, xerr=[[change["mean"] - change["low"]], [change["high"] - change["mean"]]],
                        fmt="o", color="black" if y == len(per_run) else "tab:blue", capsize=3)
        ax.axvline(goal.high_percent, color="tab:red", linestyle="--")
        ax.axvline(0, color="grey", linewidth=0.5)
        ax.set_title(f"{goal.label} @ {c} streams, % vs bare vLLM\n"
                     f"(red: goal, upper end at most {goal.high_percent:+g}%)", fontsize=9)
    axes[0].set_yticks(range(len(labels)), labels, fontsize=8)
    axes[0].invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path, help="directories holding a run's overhead.json and overhead.md")
    parser.add_argument("--out", type=Path, default=RESULTS / "runs")
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)

    per_run: dict[str, dict] = {}
    changes: dict[str, list[np.ndarray]] = {}
    for run in args.runs:
        rows = json.loads((run / "overhead.json").read_text())
        summary = {"machine": machine_of(run)}
        for c in GOAL_CONCURRENCY:
            for goal in GOALS:
                key = measure_key(goal, c)
                per_round = round_changes(rows, goal.per_round, c)
                summary[key] = bootstrap_mean(per_round)
                changes.setdefault(key, []).append(per_round)
            summary[f"rounds@{c}"] = len(per_round)
        per_run[run.name] = summary
    machines = {s["machine"] for s in per_run.values()}
    if len(machines) > 1:
        parser.error(f"the runs are from {len(machines)} machines ({', '.join(sorted(machines))}); "
                     "pool runs of one machine kind")
    pooled = {key: two_level_percent(runs) for key, runs in changes.items()}

    columns = [(goal, c) for goal in GOALS for c in GOAL_CONCURRENCY]
    header = ("| run | machine | rounds | " + " | ".join(f"{g.label} @{c}" for g, c in columns) + " |\n"
              + "|---" * (3 + len(columns)) + "|\n")
    table = header + "".join(
        f"| {name} | {s['machine']} | {'/'.join(str(s[f'rounds@{c}']) for c in GOAL_CONCURRENCY)} | "
        + " | ".join(interval_text(s[measure_key(g, c)]) for g, c in columns) + " |\n"
        for name, s in per_run.items())
    table += (f"| all {len(per_run)} runs (two-level bootstrap) | | | "
              + " | ".join(interval_text(pooled[measure_key(g, c)]) for g, c in columns) + " |\n")
    rows = [{"variant": ENSEMBLE.name, "concurrency": c, **{g.measure: pooled[measure_key(g, c)] for g in GOALS}}
            for c in GOAL_CONCURRENCY]
    verdicts = goal_verdicts(rows)
    print(table + "".join(f"goal, all runs: {line}\n" for line in verdicts))

    args.out.mkdir(parents=True, exist_ok=True)
    plot(per_run, pooled, args.out / "overhead_runs.png")
    (args.out / "overhead_runs.json").write_text(json.dumps({"runs": per_run, "all_runs": pooled}, indent=1))
    command = " ".join(["python perf/overhead_runs.py", *argv])
    (args.out / "overhead_runs.md").write_text(
        "# Serving overhead over several runs: the ensemble against bare AsyncLLM\n\n"
        f"Command: `{command}`. Per run: the mean of its rounds' changes with that run's 95% bootstrap interval "
        "(as its own overhead.md). All runs: the mean of the runs' means, with a 95% interval from resampling "
        "runs and then each picked run's rounds, so it holds the spread between runs as well as within them.\n\n"
        f"{table}\n" + "".join(f"- all runs: {line}\n" for line in verdicts)
        + "\n![runs](overhead_runs.png)\n")
    print(f"wrote {args.out / 'overhead_runs.md'}")


if __name__ == "__main__":
    main()
