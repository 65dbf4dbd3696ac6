"""Lets PyPI's torchvision (a CUDA build) import beside torch+cpu, for vLLM's
Qwen3.5/3.6 models.

vLLM's `qwen3_5.py` imports `qwen3_vl.py`, which imports transformers' Qwen2-VL
image processor, which imports `torchvision.transforms.v2` at module level.
torchvision 0.28's compiled ops do not load beside torch 2.13+cpu, and then its
`_meta_registrations` fails on the two operators it registers without checking
that the library loaded: `torchvision::nms` and `torchvision::qnms`. Defining
those two schemas first lets the import finish; torchvision's pure-torch code
(the transforms) works, its compiled detection ops stay unavailable, and text
serving uses neither.

It must happen before torchvision is imported in every process, and vLLM
starts several (an inspection subprocess, the EngineCore, its workers), so
`make setup` installs a `.pth` file into the CPU venv that calls `install()`
at interpreter start. Never on GPU hosts: there torchvision's own library
defines these operators, and defining them first would clash. `install()` only adds an import hook: torch is imported,
and the schemas defined, when something imports torchvision.
"""
from __future__ import annotations

import importlib.abc
import sys

SCHEMAS = (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
)
_library = None  # kept alive: dropping a torch.library.Library removes its definitions


def define_missing_schemas() -> None:
    global _library
    import torch

    missing = [s for s in SCHEMAS if not _has_schema(f"torchvision::{s.split('(')[0]}")]
    if missing:
        _library = torch.library.Library("torchvision", "DEF")
        for schema in missing:
            _library.define(schema)


def _has_schema(qualified_name: str) -> bool:
    import torch

    try:
        torch._C._get_schema(qualified_name, "")
        return True
    except RuntimeError:
        return False


class _BeforeTorchvision(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname == "torchvision":
            sys.meta_path.remove(self)
            define_missing_schemas()
        return None  # the regular finders import it


def install() -> None:
    if "torchvision" not in sys.modules and not any(isinstance(f, _BeforeTorchvision) for f in sys.meta_path):
        sys.meta_path.insert(0, _BeforeTorchvision())
