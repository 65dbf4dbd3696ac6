"""Qwen3.6-35B-A3B's A3B tensors split across every GPU profile's ranks, at the real sizes (pure
Python, a3b_backend/engine/partition.py), and the shared expert replicated where a split would cut
its blocks."""
import dataclasses
import json

import pytest

from a3b_backend.engine import partition
from a3b_backend.prepare.qwen_tiny import FULL_SIZE
from a3b_backend.profiles import PROJECT_ROOT, get_profile

BLOCK = (1, 128)
GPU_PROFILES = ("h200", "a100x8", "multinode")


@pytest.fixture(scope="module")
def qwen36() -> dict:
    """Qwen3.6-35B-A3B's text config: qwen-tiny's (the real head sizes) at the real widths."""
    return {**json.loads((PROJECT_ROOT / "models" / "qwen3.6-tiny" / "config.json").read_text()), **FULL_SIZE}


@pytest.mark.parametrize("name", GPU_PROFILES)
def test_every_gpu_profile_gives_each_rank_whole_blocks(qwen36, name):
    assert partition.problems(get_profile(name), qwen36, BLOCK) == []


def test_without_expert_parallelism_tp8_would_cut_blocks_and_the_check_says_where(qwen36):
    profile = dataclasses.replace(get_profile("a100x8"), enable_expert_parallel=False)
    found = partition.problems(profile, qwen36, BLOCK)
    assert len(found) == 2 and all("64 input columns" in p and "128-column blocks" in p for p in found)
    assert "routed expert down_proj" in found[0] and "shared expert down_proj" in found[1]


def test_replicating_the_shared_expert_costs_each_gpu_tens_of_megabytes(qwen36):
    extra = partition.replicated_bytes(qwen36, get_profile("a100x8"), BLOCK)
    assert 50e6 < extra < 70e6  # 40 layers x 3 x 512 x 2048 weights at ~4.25 bits, less the 1/8 a split keeps
    assert partition.replicated_bytes(qwen36, get_profile("h200"), BLOCK) == 0


def test_vllm_replicates_an_a3b_shared_expert_a_split_would_cut():
    from vllm.model_executor.models import qwen3_next

    from a3b_backend.engine import plugin
    from a3b_backend.engine.a3b_method import A3BQuantConfig
    from a3b_backend.quant.format import A3BConfig

    plugin.register()
    config = A3BQuantConfig(A3BConfig(*BLOCK), r"\.layers\.")
    group = qwen3_next.get_quark_ocp_mx_group_size(config, "model.layers.0.mlp.shared_expert.down_proj")
    assert group == 128
    assert qwen3_next._should_replicate_misaligned_shared_expert(512, 8, group, True, False)
    assert not qwen3_next._should_replicate_misaligned_shared_expert(512, 4, group, True, False)
    assert qwen3_next.get_quark_ocp_mx_group_size(None, "model.layers.0.mlp.shared_expert.down_proj") is None
