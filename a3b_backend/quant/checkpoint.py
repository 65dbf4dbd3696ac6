"""What a checkpoint directory holds besides its weight tensors, and how one is
written: into DIR.partial, renamed to DIR only once complete, so an interrupted
conversion or download never leaves a directory that looks finished.
Standard library only: the request path and the renderer read these names too."""
from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path
from typing import Callable, Iterator

# Outside the top level, where vLLM loads every *.safetensors file as weights.
INPUT_SCALES_FILE = "a3b/input_scales.safetensors"
ROW_DIVISORS_FILE = "a3b/row_divisors.safetensors"
# Tokenizer and generation files a converted checkpoint takes over from its source.
COPIED_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
                "chat_template.jinja", "vocab.json", "merges.txt", "tokenizer.model")


@contextlib.contextmanager
def building(dst: Path, resume: bool = False) -> Iterator[Path]:
    """Yields DST.partial to write into; on success it replaces DST (an existing DST is
    removed). Without `resume` it starts empty and a failure removes it; with `resume` what
    an interrupted run left there is kept, and stays after a failure for the next run."""
    partial = dst.with_name(dst.name + ".partial")
    if not resume:
        shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True, exist_ok=True)
    try:
        yield partial
    except BaseException:
        if not resume:
            shutil.rmtree(partial, ignore_errors=True)
        raise
    shutil.rmtree(dst, ignore_errors=True)
    os.replace(partial, dst)


def write_atomic(write: Callable[[Path], object], path: Path) -> None:
    """`write(tmp)` then tmp renamed to `path`: an interruption leaves the old file or none, never half of one."""
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    os.replace(tmp, path)
