"""Running the project's perf_analyzer (scripts/perf_analyzer.sh, installed by
`make perf-tools`) and reading back its `--profile-export-file`."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from a3b_backend.profiles import PROJECT_ROOT

SCRIPT = PROJECT_ROOT / "scripts" / "perf_analyzer.sh"


def command(args: list[str], export: Path) -> list[str]:
    return ["bash", str(SCRIPT), *args, "--profile-export-file", str(export)]


def run(args: list[str], export: Path, log: Path, attempts: int = 3, timeout_s: float = 1200) -> dict[str, Any]:
    """Runs perf_analyzer, its output in `log`, and returns its export. It
    refuses an export path that exists, so a rerun removes the last one; and
    it now and then exits 0 with its export cut short or empty, so such a run
    is repeated (said on stderr)."""
    for attempt in range(1, attempts + 1):
        export.unlink(missing_ok=True)
        with open(log, "w") as out:
            done = subprocess.run(command(args, export), stdout=out, stderr=subprocess.STDOUT, timeout=timeout_s)
        if done.returncode != 0:
            raise RuntimeError(f"perf_analyzer exited {done.returncode}; see {log}:\n{log.read_text()[-2000:]}")
        try:
            return json.loads(export.read_text())
        except (OSError, json.JSONDecodeError) as err:
            print(f"perf_analyzer's export {export} is unreadable ({err}; attempt {attempt} of {attempts}): "
                  "running it again", file=sys.stderr)
    raise RuntimeError(f"perf_analyzer wrote no readable export to {export} in {attempts} runs; see {log}")
