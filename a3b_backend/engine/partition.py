"""How vLLM splits Qwen3.6-35B-A3B's A3B tensors across a profile's GPUs, and whether every
rank's piece is whole blocks. Pure Python, from the model's sizes: what a load at TP/EP would
refuse (`A3BLinearMethod._check_partitioning`) is found before any GPU is rented.

vLLM's layout for Qwen3.5/3.6 (vllm/model_executor/models/qwen3_next.py, qwen3_5.py):
- column-parallel (output split by TP): DeltaNet's in_proj_qkv / in_proj_z, attention's q/k/v
  (KV heads fewer than TP are replicated), the shared expert's gate/up;
- row-parallel (input split by TP): DeltaNet's out_proj, attention's o_proj, the shared expert's
  down_proj;
- routed experts: whole experts per rank under expert parallelism, else every expert's
  intermediate split by TP (w13 by output, w2 by input);
- the shared expert is replicated, not split, where a split would cut its quantization groups
  and expert or sequence parallelism is on (`_should_replicate_misaligned_shared_expert`, which
  the plugin points at A3B's block columns, `plugin.register`).
"""
from __future__ import annotations

import dataclasses
import math

from a3b_backend.profiles import Profile
from a3b_backend.quant.format import stored_tensors


@dataclasses.dataclass(frozen=True)
class Piece:
    tensor: str  # which weight, in words
    full: tuple[int, int]  # [out, in]
    rank: tuple[int, int]  # one rank's [out, in]


def shared_expert_replicated(intermediate: int, tp: int, block_cols: int, expert_parallel: bool) -> bool:
    """vLLM's rule, with A3B's block columns as the group: replicate when a TP split would cut them
    and expert parallelism is on."""
    split, remainder = divmod(intermediate, tp)
    return expert_parallel and (remainder != 0 or split % block_cols != 0)


def pieces(config: dict, tp: int, expert_parallel: bool, block_cols: int) -> list[Piece]:
    """Each A3B weight of one Qwen3.6 decoder layer of each kind and its piece on one rank."""
    hidden, heads, kv_heads, head_dim = (config["hidden_size"], config["num_attention_heads"],
                                         config["num_key_value_heads"], config["head_dim"])
    k_heads, v_heads = config["linear_num_key_heads"], config["linear_num_value_heads"]
    k_dim, v_dim = config["linear_key_head_dim"], config["linear_value_head_dim"]
    expert, shared = config["moe_intermediate_size"], config["shared_expert_intermediate_size"]

    def column(name: str, out: int, inp: int, replicated_heads: bool = False) -> Piece:
        return Piece(name, (out, inp), (out if replicated_heads else out // tp, inp))

    def row(name: str, out: int, inp: int) -> Piece:
        return Piece(name, (out, inp), (out, inp // tp))

    qkv = 2 * k_heads * k_dim + v_heads * v_dim
    out = [column("DeltaNet in_proj_qkv", qkv, hidden), column("DeltaNet in_proj_z", v_heads * v_dim, hidden),
           row("DeltaNet out_proj", hidden, v_heads * v_dim),
           column("attention q_proj (with its output gate)", 2 * heads * head_dim, hidden),
           column("attention k_proj", kv_heads * head_dim, hidden, replicated_heads=kv_heads < tp),
           column("attention v_proj", kv_heads * head_dim, hidden, replicated_heads=kv_heads < tp),
           row("attention o_proj", hidden, heads * head_dim)]
    if expert_parallel:
        out += [Piece("routed expert gate/up", (2 * expert, hidden), (2 * expert, hidden)),
                Piece("routed expert down_proj", (hidden, expert), (hidden, expert))]
    else:
        out += [column("routed expert gate/up", 2 * expert, hidden), row("routed expert down_proj", hidden, expert)]
    if shared_expert_replicated(shared, tp, block_cols, expert_parallel):
        out += [Piece("shared expert gate/up (replicated)", (2 * shared, hidden), (2 * shared, hidden)),
                Piece("shared expert down_proj (replicated)", (hidden, shared), (hidden, shared))]
    else:
        out += [column("shared expert gate/up", 2 * shared, hidden), row("shared expert down_proj", hidden, shared)]
    return out


def problems(profile: Profile, config: dict, block: tuple[int, int]) -> list[str]:
    """What a load of the model under `profile` would refuse: rank pieces that cut A3B blocks."""
    rows, cols = block
    tp = profile.tensor_parallel_size
    found = []
    for piece in pieces(config, tp, profile.enable_expert_parallel, cols):
        (out, inp), (rank_out, rank_in) = piece.full, piece.rank
        if rank_out * tp != out and rank_out != out or rank_out % rows:
            found.append(f"{profile.name}: {piece.tensor} [{out}, {inp}] gives each of {tp} ranks {rank_out} rows, "
                         f"which cuts {rows}-row blocks")
        if rank_in != inp and (rank_in * tp != inp or rank_in % cols):
            found.append(f"{profile.name}: {piece.tensor} [{out}, {inp}] gives each of {tp} ranks {rank_in} input "
                         f"columns, which cuts {cols}-column blocks")
    return found


def replicated_bytes(config: dict, profile: Profile, block: tuple[int, int]) -> int:
    """What replicating the shared expert costs each rank over splitting it: its stored A3B bytes
    (codes and metadata, `format.stored_tensors`) times (1 - 1/TP), over every layer."""
    tp = profile.tensor_parallel_size
    shared, hidden = config["shared_expert_intermediate_size"], config["hidden_size"]
    if not shared_expert_replicated(shared, tp, block[1], profile.enable_expert_parallel):
        return 0
    per_layer = sum(spec.dtype.itemsize * math.prod(spec.shape)
                    for out, inp in ((shared, hidden), (shared, hidden), (hidden, shared))
                    for kind, spec in stored_tensors(out, inp, block).items() if kind != "shape")
    return int(config["num_hidden_layers"] * per_layer * (1 - 1 / tp))
