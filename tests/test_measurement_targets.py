"""Every measurement target builds its commands from a fresh clone: `make -n`
of each documented target, `--help` of each perf script (its imports and
arguments), and the dry runs of the scripts that drive external tools."""
from __future__ import annotations

import re
import subprocess
import sys

import pytest
from a3b_backend.profiles import PROJECT_ROOT

# every perf script but locust's file and the token source (a Triton model)
PERF_SCRIPTS = sorted(str(p.relative_to(PROJECT_ROOT / "perf")) for p in (PROJECT_ROOT / "perf").rglob("*.py")
                      if p.name not in ("locustfile.py", "model.py"))


def phony_targets() -> list[str]:
    match = re.search(r"^\.PHONY:(.*)$", (PROJECT_ROOT / "Makefile").read_text(), re.MULTILINE)
    return match.group(1).split()


def run(*cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("target", phony_targets())
def test_make_target_expands(target):
    done = run("make", "-n", target)
    assert done.returncode == 0, done.stderr


DOCS = [PROJECT_ROOT / "README.md", PROJECT_ROOT / "perf" / "README.md", PROJECT_ROOT / "kernels" / "README.md",
        *sorted((PROJECT_ROOT / "docs").glob("*.md"))]


def test_every_documented_target_is_phony():
    """The README, perf/README, kernels/README and docs/ name targets that exist."""
    documented = set()
    for doc in DOCS:
        documented |= set(re.findall(r"`make ([a-z][a-z0-9-]*)", doc.read_text()))
    assert documented <= set(phony_targets()), documented - set(phony_targets())


def test_readme_is_a_front_door_whose_links_exist():
    text = (PROJECT_ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 300
    linked = re.findall(r"\]\((?!https?:)([^)#]+)\)", text) + re.findall(r"\b((?:docs|perf|kernels)/[\w/.-]+\.md)\b", text)
    assert linked and all((PROJECT_ROOT / path).is_file() for path in linked), \
        [path for path in linked if not (PROJECT_ROOT / path).is_file()]


@pytest.mark.parametrize("script", PERF_SCRIPTS)
def test_perf_script_help(script):
    done = run(sys.executable, f"perf/{script}", "--help")
    assert done.returncode == 0 and "usage:" in done.stdout, done.stderr[-2000:]


def test_perf_sweep_dry_run(tmp_path):
    done = run(sys.executable, "perf/run_perf.py", "--profile", "cpu", "--out", str(tmp_path), "--dry-run")
    assert done.returncode == 0, done.stderr[-2000:]
    commands = [line for line in done.stdout.splitlines() if "perf_analyzer.sh" in line]
    assert commands and all("perf_analyzer.sh" in c and "--profile-export-file" in c for c in commands)


def test_aiperf_dry_run(tmp_path):
    done = run(sys.executable, "perf/aiperf.py", "--out", str(tmp_path), "--dry-run")
    assert done.returncode == 0, done.stderr[-2000:]
    genai, aiperf = done.stdout.strip().splitlines()
    assert "genai_perf.sh profile" in genai and "aiperf profile" in aiperf
