"""vLLM quantization method "a3b": serve A3B checkpoints (docs/a3b_format.md) natively.

Registered in every vLLM process (the EngineCore and its workers included)
through the `vllm.general_plugins` entry point (a3b_backend/engine/plugin.py). vLLM picks it from
the checkpoint's config.json `quantization_config.quant_method`.

The packed codes and the stored metadata are loaded as they are, sharded by
vLLM's tensor-parallel loaders (merged qkv / gate_up shards land at their
offsets), and stay packed while serving. Each layer's kernels are chosen when its
weights load (`kernel_for`, kept on the layer as `a3b_kernel`):
  cpu     the C++ kernel (a3b_kernels.cpu), strategy from $A3B_CPU_LINEAR;
  triton  the Triton-language kernels as the custom ops a3b::gpu_linear and
          a3b::gpu_moe (a3b_kernels.triton.ops); on CUDA with 1 x C blocks (other
          block shapes take a torch dequantize + matmul path), and on the CPU under
          $A3B_KERNEL=triton with TRITON_INTERPRET=1: vLLM's real call path into the
          GPU branch, checked without a GPU.
$A3B_CPU_LINEAR=expand dequantizes every weight to the model dtype at load
instead: an explicit option for comparison, never the default.
"""
from __future__ import annotations

import functools
import os
import re
from typing import Any

import torch
from vllm.logger import init_logger
from vllm.model_executor.layers.fused_moe.activation import MoEActivation
from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase
from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
from vllm.model_executor.layers.linear import LinearBase, LinearMethodBase, UnquantizedLinearMethod
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig, QuantizeMethodBase
from vllm.model_executor.parameter import BasevLLMParameter, PackedColumnParameter, PackedvLLMParameter

from a3b_backend.quant.format import (KERNEL_KINDS, KINDS, A3BConfig, A3BWeight, Kind, QuantizationError,
                                      StoredTensor, check_stored_shape, dequantize, stored_tensors)
from a3b_kernels import cpu as cpu_kernels

logger = init_logger("vllm.a3b")  # under vLLM's logger, so its workers print it
NAME = "a3b"
STRATEGY_ENV = "A3B_CPU_LINEAR"
DEFAULT_CPU_STRATEGY = "fused"
CPU_STRATEGIES = (*cpu_kernels.STRATEGIES, "expand")


class A3BCheckpointError(ValueError):
    """The checkpoint's A3B tensors do not fit its config or the model."""


def announce_path(layer_kind: str, path: str, dtype: torch.dtype) -> None:
    """Logs, once per process, each way A3B layers compute (tests read it).
    Not while torch.compile traces: a logger call breaks its graph capture."""
    if not torch.compiler.is_compiling():
        _announce_once(layer_kind, path, dtype)


@functools.cache
def _announce_once(layer_kind: str, path: str, dtype: torch.dtype) -> None:
    logger.info("A3B %s: %s path, %s activations", layer_kind, path, str(dtype).removeprefix("torch."))


def cpu_linear(layer_kind: str, x: torch.Tensor, weight: A3BWeight, block: tuple[int, int],
               strategy: cpu_kernels.Strategy) -> torch.Tensor:
    announce_path(layer_kind, f"CPU {cpu_kernels.path(x.shape[0], strategy)}", x.dtype)
    return cpu_kernels.linear(x, weight, block, strategy)


KERNEL_ENV = "A3B_KERNEL"  # "triton": the Triton kernels on the CPU too (under TRITON_INTERPRET=1)


def kernel_for(device: torch.device) -> str:
    """"triton" on CUDA or where $A3B_KERNEL asks for it, else "cpu": read when weights load (as
    `cpu_strategy`), never in `apply`."""
    chosen = os.environ.get(KERNEL_ENV, "triton" if device.type == "cuda" else "cpu")
    if chosen not in ("cpu", "triton"):
        raise ValueError(f"{KERNEL_ENV}={chosen!r}; allowed: cpu, triton")
    return chosen


def cpu_strategy() -> str:
    """Read when weights load, kept on the layer: torch.compile traces `apply`,
    where an environment lookup has no place."""
    chosen = os.environ.get(STRATEGY_ENV, DEFAULT_CPU_STRATEGY)
    if chosen not in CPU_STRATEGIES:
        raise ValueError(f"{STRATEGY_ENV}={chosen!r}; allowed: {', '.join(CPU_STRATEGIES)}")
    return chosen


class A3BQuantConfig(QuantizationConfig):
    def __init__(self, format_config: A3BConfig, quantized_layers: str):
        super().__init__()
        self.format = format_config
        self.block = format_config.block
        self.quantized_layers = re.compile(quantized_layers)

    def get_name(self) -> str:
        return NAME

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16, torch.float32]

    @classmethod
    def get_min_capability(cls) -> int:
        return 80

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "A3BQuantConfig":
        try:
            format_config = A3BConfig.from_json(config)
        except QuantizationError as exc:
            raise A3BCheckpointError(str(exc)) from None
        pattern = config.get("quantized_layers")
        if not isinstance(pattern, str):
            raise A3BCheckpointError("quantization_config.quantized_layers is missing: a regex of module names")
        try:
            return cls(format_config, pattern)
        except re.error as exc:
            raise A3BCheckpointError(f"quantization_config.quantized_layers is not a valid regex: {exc}") from None

    def checkpoint_names(self, prefix: str) -> list[str]:
        """The checkpoint module names behind a (possibly merged) vLLM layer."""
        parent, _, last = prefix.rpartition(".")
        shards = self.packed_modules_mapping.get(last)
        return [f"{parent}.{s}" if parent else s for s in shards] if shards else [prefix]

    def get_quant_method(self, layer: torch.nn.Module, prefix: str) -> QuantizeMethodBase | None:
        if isinstance(layer, LinearBase):
            names = self.checkpoint_names(prefix)
            quantized = [bool(self.quantized_layers.search(n)) for n in names]
            if all(quantized):
                return A3BLinearMethod(self, names)
            if any(quantized):
                raise A3BCheckpointError(
                    f"{prefix}: vLLM merges {', '.join(names)} into one layer, but quantized_layers matches only "
                    f"some of them ({', '.join(n for n, q in zip(names, quantized) if q)})")
            return UnquantizedLinearMethod()
        if isinstance(layer, RoutedExperts):
            return A3BMoEMethod(self, layer.moe_config, prefix)
        return None


def _checkpoint_shapes(layer: torch.nn.Module, shards: int, output_size: int,
                       input_size: int) -> list[tuple[int, int]]:
    """Full (unsharded) [out, in] of each checkpoint weight behind a layer."""
    if hasattr(layer, "total_num_kv_heads"):  # QKVParallelLinear
        kv = layer.total_num_kv_heads * getattr(layer, "v_head_size", layer.head_size)
        return [(layer.total_num_heads * layer.head_size, input_size), (layer.total_num_kv_heads * layer.head_size,
                                                                          input_size), (kv, input_size)]
    if shards > 1:  # MergedColumnParallelLinear
        return [(size, input_size) for size in layer.output_sizes]
    return [(output_size, input_size)]


ShardId = int | str | tuple[int, ...] | None


def _shard_indices(shard_id: ShardId, shards: int) -> tuple[int, ...]:
    """The vLLM output shards one loaded checkpoint tensor fills: all of them (None),
    one (an index, or q/k/v), or several (a tuple: one checkpoint weight vLLM
    splits, as Gated DeltaNet's in_proj_qkv over the q, k, v shards of in_proj_qkvz)."""
    if shard_id is None:
        return tuple(range(shards))
    if isinstance(shard_id, tuple):
        return shard_id
    return ({"q": 0, "k": 1, "v": 2}.get(shard_id, shard_id),)  # type: ignore[arg-type]


def _shard_names(names: list[str], shards: int) -> list[str]:
    """The checkpoint weight behind each vLLM output shard. With fewer weights than
    shards, the first weight spans the surplus (in_proj_qkv: q, k, v; in_proj_z: z)."""
    if len(names) >= shards:
        return names[:shards] if shards > 1 else names[:1]
    return [names[0]] * (shards - len(names) + 1) + names[1:]


class A3BLinearMethod(LinearMethodBase):
    """One linear layer (or a merged qkv / gate_up) with A3B weights."""

    def __init__(self, config: A3BQuantConfig, checkpoint_names: list[str]):
        self.config = config
        self.names = checkpoint_names

    def create_weights(self, layer: torch.nn.Module, input_size_per_partition: int, output_partition_sizes: list[int],
                       input_size: int, output_size: int, params_dtype: torch.dtype, **extra_weight_attrs):
        rows = self.config.block[0]
        load = extra_weight_attrs["weight_loader"]
        out = sum(output_partition_sizes)
        self._check_partitioning(output_partition_sizes, input_size_per_partition, input_size)
        self.shard_shapes = _checkpoint_shapes(layer, len(output_partition_sizes), output_size, input_size)
        self.shard_names = _shard_names(self.names, len(self.shard_shapes))
        layer.a3b_loaded = set()
        layer.a3b_shape = (out, input_size_per_partition)

        def checked(kind: Kind):
            def loader(param, loaded_weight, loaded_shard_id=None):
                name = self._check_tensor(kind, loaded_shard_id, loaded_weight)
                layer.a3b_loaded.add((kind, name))
                if kind == "shape":
                    return
                if loaded_shard_id is None:
                    return load(param, loaded_weight)
                return load(param, loaded_weight, loaded_shard_id)
            return loader

        for kind, spec in stored_tensors(out, input_size_per_partition, self.config.block).items():
            layer.register_parameter(f"weight_{kind}", _sharded_parameter(kind, spec, rows, checked(kind)))

    def _check_partitioning(self, output_partition_sizes: list[int], input_per_partition: int, input_size: int):
        rows, cols = self.config.block
        if len(output_partition_sizes) > 1 and any(size % rows for size in output_partition_sizes):
            raise A3BCheckpointError(
                f"{', '.join(self.names)}: merged output sizes {output_partition_sizes} are not multiples of the "
                f"block rows ({rows}); quantize with block_shape [1, C]")
        if input_per_partition != input_size and input_per_partition % cols:
            raise A3BCheckpointError(
                f"{self.names[0]}: tensor-parallel input slices of {input_per_partition} columns cut A3B blocks of "
                f"{cols} columns; choose a tensor-parallel size that divides the blocks")

    def _check_tensor(self, kind: Kind, shard_id: ShardId, loaded: torch.Tensor) -> str:
        """Checks a loaded tensor against the weight behind its shards; returns that weight's name."""
        indices = _shard_indices(shard_id, len(self.shard_shapes))
        rows = sum(self.shard_shapes[i][0] for i in indices)
        name = self.shard_names[indices[0]]
        check_stored_tensor(f"{name}.weight_{kind}", kind, loaded, (rows, self.shard_shapes[0][1]), self.config.block)
        return name

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        missing = [f"{name}.weight_{kind}" for name in dict.fromkeys(self.shard_names)
                   for kind in KINDS if (kind, name) not in layer.a3b_loaded]
        if missing:
            raise A3BCheckpointError(f"A3B tensors missing from the checkpoint: {', '.join(missing)}")
        del layer.weight_shape
        layer.a3b = A3BWeight.for_kernels({k: getattr(layer, f"weight_{k}").data for k in KERNEL_KINDS},
                                          *layer.a3b_shape)
        layer.a3b_strategy = cpu_strategy()
        layer.a3b_kernel = kernel_for(layer.weight_packed.device)
        if layer.a3b_kernel == "cpu" and layer.a3b_strategy == "expand":
            weight = cpu_kernels.dequantize(layer.a3b, self.config.block)
            for k in KERNEL_KINDS:
                delattr(layer, f"weight_{k}")
            layer.a3b = None
            layer.weight = torch.nn.Parameter(weight.to(layer.params_dtype), requires_grad=False)

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if layer.a3b is None:  # expanded at load
            return torch.nn.functional.linear(x, layer.weight, bias)
        x2 = x.reshape(-1, x.shape[-1])
        if layer.a3b_kernel == "cpu":  # in x's dtype from the kernel
            y = cpu_linear("linear", x2, layer.a3b, self.config.block, layer.a3b_strategy)
        elif self.config.block[0] == 1:
            announce_path("linear", "Triton a3b::gpu_linear", x.dtype)
            y = gpu_linear(x2, layer.a3b, self.config.format).to(x.dtype)
        else:
            y = (x2.float() @ dequantize(layer.a3b, self.config.format).T).to(x.dtype)
        y = y.reshape(*x.shape[:-1], -1)
        return y if bias is None else y + bias


def _sharded_parameter(kind: Kind, spec: StoredTensor, block_rows: int, loader) -> torch.nn.Parameter:
    """A stored tensor as the vLLM parameter whose loader shards it as its weight is sharded:
    codes along both dimensions, per-block metadata by block rows and columns, row scales by block rows."""
    data = torch.empty(spec.shape, dtype=spec.dtype)
    if kind == "packed":
        return PackedvLLMParameter(data=data, input_dim=1, output_dim=0, packed_dim=1, packed_factor=2,
                                   weight_loader=loader)
    if kind == "shape":  # read only to check it against the model's shape; never loaded into the layer
        return BasevLLMParameter(data=data, weight_loader=loader)
    if len(spec.shape) == 2:
        return PackedvLLMParameter(data=data, input_dim=1, output_dim=0, packed_dim=0, packed_factor=block_rows,
                                   weight_loader=loader)
    return PackedColumnParameter(data=data, output_dim=0, packed_dim=0, packed_factor=block_rows,
                                 weight_loader=loader)


def gpu_linear(x: torch.Tensor, weight: A3BWeight, config: A3BConfig) -> torch.Tensor:
    """float32 x @ W^T by the Triton A3B kernel (the `a3b::gpu_linear` custom op), W's codes read in place."""
    from a3b_kernels.triton import ops

    return ops.gpu_linear(x, *weight.kernel_tensors(), config.block_cols)


def gpu_moe(x: torch.Tensor, w13: A3BWeight, w2: A3BWeight, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
            group: int) -> torch.Tensor:
    """float32 routed-expert output by the grouped Triton A3B MoE kernel (the `a3b::gpu_moe` custom op;
    ids < 0: another rank's)."""
    from a3b_kernels.triton import ops

    return ops.gpu_moe(x, *w13.kernel_tensors(), *w2.kernel_tensors(), topk_weights, topk_ids, group)


def check_stored_tensor(name: str, kind: Kind, loaded: torch.Tensor, weight_shape: tuple[int, int],
                        block: tuple[int, int]) -> None:
    """Refuse a stored A3B tensor that does not fit the model's [out, in] weight and the block shape."""
    try:
        check_stored_shape(name, kind, tuple(loaded.shape), weight_shape, block, "quantization_config.block_shape")
    except QuantizationError as exc:
        raise A3BCheckpointError(str(exc)) from None
    out, inp = weight_shape
    if kind == "shape" and loaded.tolist() != [out, inp]:
        raise A3BCheckpointError(f"{name} = {loaded.tolist()} but the model expects a [{out}, {inp}] weight")


EXPERT_PROJ = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


class A3BMoEMethod(FusedMoEMethodBase):
    """Routed experts with A3B weights: w13 = [gate; up] and w2 = down per expert."""

    def __init__(self, config: A3BQuantConfig, moe, prefix: str):
        super().__init__(moe)
        self.config = config
        self.prefix = prefix

    def create_weights(self, layer: torch.nn.Module, num_experts: int, hidden_size: int,
                       intermediate_size_per_partition: int, params_dtype: torch.dtype, **extra_weight_attrs):
        rows, cols = self.config.block
        inter, tp = intermediate_size_per_partition, self.moe.tp_size
        if inter % rows or (tp > 1 and inter % cols):
            raise A3BCheckpointError(
                f"{self.prefix}: expert intermediate size {inter} per tensor-parallel rank does not split into "
                f"A3B blocks of {rows}x{cols}")
        # Per-partition [out, in] of each stem, and the full checkpoint [out, in] of one shard.
        self.partition = {"w13": (2 * inter, hidden_size), "w2": (hidden_size, inter)}
        self.checkpoint = {"w1": (inter * tp, hidden_size), "w3": (inter * tp, hidden_size),
                           "w2": (hidden_size, inter * tp)}
        layer.a3b_loaded = set()
        for stem, (out, inp) in self.partition.items():
            for kind, spec in stored_tensors(out, inp, self.config.block).items():
                param = torch.nn.Parameter(torch.empty(num_experts, *spec.shape, dtype=spec.dtype),
                                           requires_grad=False)
                param.weight_loader = self._loader(layer, kind)
                layer.register_parameter(f"{stem}_weight_{kind}", param)

    def _loader(self, layer: torch.nn.Module, kind: Kind):
        def load(param, loaded_weight, weight_name, shard_id, expert_id, return_success=False):
            local = layer._map_global_expert_id_to_local_expert_id(expert_id)
            if local == -1:
                return False if return_success else None
            check_stored_tensor(f"{self.prefix}.{expert_id}.{EXPERT_PROJ[shard_id]}.weight_{kind}", kind,
                                loaded_weight, self.checkpoint[shard_id], self.config.block)
            if kind != "shape":
                self._copy_shard(param.data[local], loaded_weight, shard_id)
            layer.a3b_loaded.add((local, shard_id, kind))
            return True if return_success else None
        return load

    def _copy_shard(self, dst: torch.Tensor, src: torch.Tensor, shard_id: str) -> None:
        rank = self.moe.tp_rank
        if shard_id == "w2":  # input dimension split across ranks; scales have none
            if src.dim() == 2:
                width = dst.shape[1]
                src = src.narrow(1, rank * width, width)
            dst.copy_(src)
            return
        half = dst.shape[0] // 2  # w13 = [gate; up], output dimension split across ranks
        dst.narrow(0, 0 if shard_id == "w1" else half, half).copy_(src.narrow(0, rank * half, half))

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        experts = layer.w13_weight_packed.shape[0]
        missing = [f"{self.prefix}.{e}.{EXPERT_PROJ[shard]}.weight_{kind}" for e in range(experts)
                   for shard in EXPERT_PROJ for kind in KINDS if (e, shard, kind) not in layer.a3b_loaded]
        if missing:
            more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
            raise A3BCheckpointError(f"A3B tensors missing from the checkpoint: {', '.join(missing[:5])}{more}")
        del layer.w13_weight_shape, layer.w2_weight_shape
        if layer.moe_config.activation != MoEActivation.SILU or layer.apply_router_weight_on_input:
            raise A3BCheckpointError(f"{self.prefix}: A3B experts support SiLU-gated experts with router weights "
                                     f"applied to the output only (got {layer.moe_config.activation})")
        layer.a3b_strategy = cpu_strategy()
        layer.a3b_kernel = kernel_for(layer.w13_weight_packed.device)
        # per projection, the experts' stacked weights: what the kernels take
        layer.a3b_experts = {
            stem: A3BWeight.for_kernels({k: getattr(layer, f"{stem}_weight_{k}") for k in KERNEL_KINDS},
                                        *self.partition[stem])
            for stem in ("w13", "w2")}

    def get_fused_moe_quant_config(self, layer: torch.nn.Module):
        return None

    def _expert_linear(self, x: torch.Tensor, layer: torch.nn.Module, stem: str, expert: int) -> torch.Tensor:
        weight = layer.a3b_experts[stem].expert(expert)
        if layer.a3b_kernel == "cpu":
            return cpu_linear("MoE expert", x, weight, self.config.block, layer.a3b_strategy)
        return x @ dequantize(weight, self.config.format).T  # torch reference path, not a kernel

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              shared_experts=None, shared_experts_input=None) -> torch.Tensor:
        ids = topk_ids if layer.expert_map is None else layer.expert_map[topk_ids.long()]
        if layer.a3b_kernel == "triton" and self.config.block[0] == 1:
            announce_path("MoE", "Triton a3b::gpu_moe", x.dtype)
            experts = layer.a3b_experts
            return gpu_moe(x, experts["w13"], experts["w2"], topk_weights, ids, self.config.block[1]).to(x.dtype)
        # The experts compute in float32, so a row's result is the same whichever path its batch takes
        # (fused or dequantize + GEMM, equal to ~1e-7); bf16 between gate_up and down would round those
        # differences up to a bf16 step, and batched streams part from their solo runs
        hidden = x.float()
        out = torch.zeros_like(hidden)
        for expert in ids.unique().tolist():
            if expert < 0:  # another rank's expert
                continue
            tokens, slot = (ids == expert).nonzero(as_tuple=True)
            gate_up = self._expert_linear(hidden[tokens], layer, "w13", expert)
            gate, up = gate_up.chunk(2, dim=-1)
            down = self._expert_linear(torch.nn.functional.silu(gate) * up, layer, "w2", expert)
            out.index_add_(0, tokens, down * topk_weights[tokens, slot, None].float())
        return out.to(x.dtype)
