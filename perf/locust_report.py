"""A locust run's CSV summary as a Markdown table and a PNG of its response-time percentiles.

    python perf/locust_report.py perf/results/locust_rag/qwen-tiny/rag      # after make locust-rag

Reads PREFIX_stats.csv (what `locust --csv PREFIX` writes) and writes PREFIX_report.md and
PREFIX_report.png beside it: per entry (the scenario's TTFT, inter-token and end-to-end entries
and its requests) the count, failures, rate and percentiles.
"""
from __future__ import annotations

import argparse
import csv
from pathlib import Path

PERCENTILES = ("50%", "66%", "75%", "80%", "90%", "95%", "98%", "99%", "100%")


def read_stats(prefix: Path) -> list[dict[str, str]]:
    with open(f"{prefix}_stats.csv", newline="") as f:
        return [row for row in csv.DictReader(f) if row["Name"] != "Aggregated"]


def markdown(rows: list[dict[str, str]], title: str) -> str:
    lines = [f"# {title}", "", "| entry | requests | failures | per s | ms p50 / p90 / p99 / max |",
             "|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row['Type']} {row['Name']} | {row['Request Count']} | {row['Failure Count']} | "
                     f"{float(row['Requests/s']):.2f} | {row['50%']} / {row['90%']} / {row['99%']} / {row['100%']} |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict[str, str]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axis = plt.subplots(figsize=(8, 4.2))
    for row in rows:
        values = [float(row[p]) if row[p] not in ("", "N/A") else float("nan") for p in PERCENTILES]
        axis.plot(range(len(PERCENTILES)), values, marker="o", label=f"{row['Name']} ({row['Request Count']})")
    axis.set_xticks(range(len(PERCENTILES)), PERCENTILES)
    axis.set_yscale("log")
    axis.set_xlabel("percentile")
    axis.set_ylabel("ms")
    axis.set_title(title)
    axis.grid(alpha=0.3)
    axis.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("prefix", type=Path, help="the --csv prefix of the locust run")
    parser.add_argument("--title", default="locust")
    args = parser.parse_args(argv)
    rows = read_stats(args.prefix)
    image = Path(f"{args.prefix}_report.png")
    Path(f"{args.prefix}_report.md").write_text(markdown(rows, args.title) + f"\n![percentiles]({image.name})\n")
    plot(rows, image, args.title)
    print(f"wrote {args.prefix}_report.md and {args.prefix}_report.png")


if __name__ == "__main__":
    main()
