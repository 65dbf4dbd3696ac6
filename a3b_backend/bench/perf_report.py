"""LLM latency metrics from per-request timestamps: perf_analyzer's
`--profile-export-file` JSON, or records from our own clients.

    python -m a3b_backend.bench.perf_report perf/results/cpu/*.json --tokenizer models/... --out perf/results/cpu

Per load level: TTFT, inter-token latency and end-to-end latency (p50/p90/p99),
output tokens/s and requests/s, as genai-perf defines them: TTFT is the first
response carrying text, inter-token latency is (last - first response) /
(output tokens - 1) per request, output tokens are counted by tokenizing the
request's whole streamed text.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import re
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import numpy as np

PERCENTILES = (50, 90, 99)
NS_PER_MS = 1e6


@dataclasses.dataclass
class RequestRecord:
    start_ns: int
    # one timestamp and one text per response that carried text
    response_ns: list[int]
    texts: list[str]
    error: str | None = None

    def add(self, stamp_ns: int, text: str) -> None:
        """A response that arrived at `stamp_ns`; one that carried no text is not counted."""
        if text:
            self.response_ns.append(stamp_ns)
            self.texts.append(text)


@dataclasses.dataclass
class LoadLevel:
    label: str  # e.g. "concurrency 4", "request_rate 3.3"
    source: str  # the input or run it measured
    records: list[RequestRecord]


@dataclasses.dataclass
class Summary:
    label: str
    source: str
    requests: int
    errors: int
    ttft_ms: dict[int, float]
    itl_ms: dict[int, float]
    e2e_ms: dict[int, float]
    output_tokens_per_s: float
    requests_per_s: float
    mean_output_tokens: float

    def row(self) -> list[str]:
        pct = lambda d: " / ".join(f"{d[p]:.1f}" for p in PERCENTILES)  # noqa: E731
        return [self.source, self.label, str(self.requests), str(self.errors), pct(self.ttft_ms),
                pct(self.itl_ms), pct(self.e2e_ms), f"{self.output_tokens_per_s:.1f}",
                f"{self.requests_per_s:.2f}", f"{self.mean_output_tokens:.1f}"]


TABLE_HEADER = ["input", "load", "requests", "errors", "TTFT ms p50/p90/p99", "ITL ms p50/p90/p99",
                "e2e ms p50/p90/p99", "output tok/s", "req/s", "output tokens/req"]


def bytes_text(value: Any) -> str:
    """perf_analyzer writes a BYTES output as the raw tensor: a 4-byte length
    prefix before the UTF-8 text when it is not valid text as it stands."""
    if isinstance(value, str):
        raw = value.encode("utf-8", errors="surrogateescape")
    else:
        raw = bytes(value)
    if len(raw) >= 4 and int.from_bytes(raw[:4], "little") == len(raw) - 4:
        raw = raw[4:]
    return raw.decode("utf-8", errors="replace")


def records_from_export(export: dict[str, Any]) -> list[LoadLevel]:
    """perf_analyzer profile export -> one LoadLevel per experiment."""
    levels = []
    for experiment in export.get("experiments", []):
        info = experiment["experiment"]
        records = []
        for req in experiment["requests"]:
            stamps, texts = [], []
            outputs = req.get("response_outputs", [{}] * len(req["response_timestamps"]))
            for ts, out in zip(req["response_timestamps"], outputs):
                text = bytes_text(out.get("text_output", "")) if out else ""
                if text:
                    stamps.append(int(ts))
                    texts.append(text)
            records.append(RequestRecord(int(req["timestamp"]), stamps, texts))
        levels.append(LoadLevel(f"{info['mode']} {info['value']}", "", records))
    return levels


def _percentiles(values: Sequence[float]) -> dict[int, float]:
    if not values:
        return {p: float("nan") for p in PERCENTILES}
    return {p: float(np.percentile(values, p)) for p in PERCENTILES}


def summarize(level: LoadLevel, count_tokens: Callable[[str], int]) -> Summary:
    ok = [r for r in level.records if r.error is None and r.response_ns]
    ttft = [(r.response_ns[0] - r.start_ns) / NS_PER_MS for r in ok]
    e2e = [(r.response_ns[-1] - r.start_ns) / NS_PER_MS for r in ok]
    tokens = [count_tokens("".join(r.texts)) for r in ok]
    itl = [(r.response_ns[-1] - r.response_ns[0]) / NS_PER_MS / (n - 1) for r, n in zip(ok, tokens) if n > 1]
    span_s = ((max(r.response_ns[-1] for r in ok) - min(r.start_ns for r in ok)) / 1e9) if ok else float("nan")
    return Summary(
        label=level.label, source=level.source, requests=len(ok), errors=len(level.records) - len(ok),
        ttft_ms=_percentiles(ttft), itl_ms=_percentiles(itl), e2e_ms=_percentiles(e2e),
        output_tokens_per_s=sum(tokens) / span_s if ok else 0.0,
        requests_per_s=len(ok) / span_s if ok else 0.0,
        mean_output_tokens=float(np.mean(tokens)) if tokens else 0.0,
    )


def markdown_table(summaries: Iterable[Summary]) -> str:
    lines = ["| " + " | ".join(TABLE_HEADER) + " |", "|" + "---|" * len(TABLE_HEADER)]
    lines += ["| " + " | ".join(s.row()) + " |" for s in summaries]
    return "\n".join(lines) + "\n"


def plot(summaries: Sequence[Summary], path: Path, title: str) -> None:
    """TTFT p50/p99, ITL p50 and output tokens/s per load level, one line per input."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    by_source: dict[str, list[Summary]] = {}
    for s in summaries:
        by_source.setdefault(s.source, []).append(s)
    for i, (source, rows) in enumerate(by_source.items()):
        x, color = [r.label for r in rows], f"C{i % 10}"
        axes[0].plot(x, [r.ttft_ms[50] for r in rows], marker="o", color=color, label=f"{source} p50")
        axes[0].plot(x, [r.ttft_ms[99] for r in rows], marker="x", linestyle="--", color=color, label="p99")
        axes[1].plot(x, [r.itl_ms[50] for r in rows], marker="o", color=color, label=source)
        axes[2].plot(x, [r.output_tokens_per_s for r in rows], marker="o", color=color, label=source)
    for ax, name in zip(axes, ("TTFT (ms)", "inter-token latency p50 (ms)", "output tokens/s")):
        ax.set_title(name)
        ax.set_xlabel("load")
        ax.grid(alpha=0.3)
        ax.tick_params(axis="x", labelrotation=30)
    axes[0].legend(fontsize=7)
    axes[2].legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def machine() -> str:
    """The CPU and core count a figure was measured on, for the report's header."""
    import os

    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), "unknown CPU") if Path("/proc/cpuinfo").exists() else "unknown CPU"
    return f"{model}, {os.cpu_count()} cores"


def token_counter(tokenizer_dir: Path) -> Callable[[str], int]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    return lambda text: len(tokenizer.encode(text, add_special_tokens=False))


def load_levels(paths: Iterable[Path]) -> list[LoadLevel]:
    levels = []
    for path in paths:
        for level in records_from_export(json.loads(path.read_text())):
            # runs of one input at several loads share a source: <input>_c<concurrency>
            level.source = re.sub(r"_c\d+$", "", path.stem)
            levels.append(level)
    return levels


def write_report(summaries: Sequence[Summary], out: Path, title: str, preamble: str = "") -> Path:
    out.mkdir(parents=True, exist_ok=True)
    plot(summaries, out / "report.png", title)
    report = out / "report.md"
    report.write_text(f"# {title}\n\n{preamble}\n\n{markdown_table(summaries)}\n![plots](report.png)\n")
    (out / "report.json").write_text(json.dumps([dataclasses.asdict(s) for s in summaries], indent=1))
    return report


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("exports", type=Path, nargs="+", help="perf_analyzer --profile-export-file outputs")
    parser.add_argument("--tokenizer", type=Path, required=True, help="model dir whose tokenizer counts tokens")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--title", default="perf_analyzer report")
    args = parser.parse_args(argv)
    count = token_counter(args.tokenizer)
    summaries = [summarize(level, count) for level in load_levels(args.exports)]
    print(markdown_table(summaries))
    print(f"wrote {write_report(summaries, args.out, args.title)}")


if __name__ == "__main__":
    main()
