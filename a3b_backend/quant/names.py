"""One map between a checkpoint's tensor names and the module names of the model
transformers builds from it: where the converter, the calibration statistics and
the norms' AWQ scales meet names.

Two layouts:
- text-only (Llama, Mistral, Qwen2/3, Qwen3-MoE, a Qwen3.5/3.6 text model): the
  decoder under `model.layers.`; checkpoint and module names are the same;
- Qwen3.5/3.6's published multimodal layout (Qwen3.6-35B-A3B as released): the
  text model under `model.language_model.`, a vision tower under `model.visual.`
  and the multi-token-prediction layer under `mtp.`. transformers loads its text
  model as `*ForCausalLM`, whose modules drop `language_model`
  (`model.language_model.layers.3.mlp` is the module `model.layers.3.mlp`); the
  vision tower and the MTP layer are not in that model at all.
Routed experts are named per expert (`mlp.experts.{e}.gate_proj`) in both; a
checkpoint that stores them stacked is split into those names first.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Iterable

# Tensors outside the text model the converter calibrates and quantizes: kept as they are.
OUTSIDE_TEXT_MODEL = re.compile(r"^(mtp\.|model\.visual\.|visual\.)")
MODULE_PREFIX = "model."


class LayoutError(ValueError):
    """A checkpoint whose tensor names match no known layout."""


@dataclasses.dataclass(frozen=True)
class Layout:
    name: str
    # where the checkpoint keeps what the loaded model calls `model.`
    text_prefix: str

    def module(self, checkpoint_name: str) -> str | None:
        """The loaded model's module for a checkpoint module name (a tensor's name without
        `.weight`); None for what the loaded text model does not hold (vision tower, MTP)."""
        if OUTSIDE_TEXT_MODEL.match(checkpoint_name):
            return None
        if checkpoint_name.startswith(self.text_prefix):
            return MODULE_PREFIX + checkpoint_name[len(self.text_prefix):]
        return checkpoint_name

    def checkpoint(self, module: str) -> str:
        """The checkpoint's name for a module of the loaded model."""
        if module.startswith(MODULE_PREFIX):
            return self.text_prefix + module[len(MODULE_PREFIX):]
        return module


PUBLISHED = Layout("published multimodal (model.language_model.*)", "model.language_model.")
TEXT_ONLY = Layout("text-only (model.layers.*)", MODULE_PREFIX)
LAYOUTS = (PUBLISHED, TEXT_ONLY)


def layout_of(tensor_names: Iterable[str]) -> Layout:
    """The layout whose decoder layers the checkpoint holds."""
    names = list(tensor_names)
    for layout in LAYOUTS:
        if any(name.startswith(f"{layout.text_prefix}layers.") for name in names):
            return layout
    shown = ", ".join(sorted(names)[:5]) + (", ..." if len(names) > 5 else "")
    raise LayoutError(f"no decoder layers found under any known layout ({'; '.join(l.name for l in LAYOUTS)}); "
                      f"the checkpoint's tensors begin: {shown or 'none'}")
