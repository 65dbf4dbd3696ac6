"""Files rendered from the package's single sources (contract, profiles) and
committed: written, or with `--check` compared with what is committed."""
from __future__ import annotations

from pathlib import Path


def write_or_check(files: dict[Path, str], check: bool) -> list[Path]:
    """Writes every file (check False) or, with check, writes nothing; -> the files that differ."""
    stale = []
    for path, text in files.items():
        if check:
            if not path.exists() or path.read_text() != text:
                stale.append(path)
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        print(f"wrote {path}")
    return stale
