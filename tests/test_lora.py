"""LoRA configuration (a3b_backend/serving/lora.py) and adapter folding (a3b_backend/serving/adapters.py), without a server."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from a3b_backend.serving import lora
from a3b_backend.serving.adapters import Adapters, fold_scales
from a3b_backend.profiles import get_profile
from a3b_backend.quant.checkpoint import INPUT_SCALES_FILE
from a3b_backend.deploy.repository import main as render
from a3b_backend.serving.sampling import parse_sampling_json
from a3b_backend.serving.tensors import RequestError

MODULE = "model.layers.0.self_attn.q_proj"


def adapter(path: Path, rank: int = 4, in_features: int = 6, **config) -> Path:
    path.mkdir(parents=True)
    (path / lora.ADAPTER_CONFIG).write_text(json.dumps({"r": rank, "lora_alpha": 8, **config}))
    save_file({f"base_model.model.{MODULE}.lora_A.weight": torch.randn(rank, in_features),
               f"base_model.model.{MODULE}.lora_B.weight": torch.randn(5, rank),
               "base_model.model.model.layers.0.mlp.down_proj.lora_A.weight": torch.randn(rank, in_features)},
              path / lora.ADAPTER_WEIGHTS)
    return path


def checkpoint(path: Path, calibrated: bool) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "a3b",
                                                                          "calibrated": calibrated}}))
    return path


def test_render_writes_and_removes_the_vllm_backend_files(tmp_path):
    repo = tmp_path / "model_repository"
    assert render(["--repository", str(repo), "--lora", f"a={adapter(tmp_path / 'a')}",
                   "--lora", f"b={adapter(tmp_path / 'b')}"]) == 0
    for model in ("a3b_llm", "ensemble"):  # ensemble: where Triton's OpenAI frontend looks
        version = repo / model / "1"
        assert json.loads((version / "model.json").read_text()) == {"enable_lora": "true"}
        assert lora.read_config(version, tmp_path) == {"a": tmp_path / "a", "b": tmp_path / "b"}
    assert render(["--repository", str(repo), "--no-lora"]) == 0
    assert not list(repo.glob("*/1/*.json"))
    assert lora.read_config(repo / "a3b_llm" / "1", tmp_path) == {}


def test_render_refuses_a_missing_adapter_directory(tmp_path, capsys):
    with pytest.raises(SystemExit):
        render(["--repository", str(tmp_path), "--lora", f"a={tmp_path / 'nowhere'}"])
    assert "does not exist" in capsys.readouterr().err


def test_config_read_like_vllm_backend(tmp_path):
    (tmp_path / "model.json").write_text(json.dumps({"enable_lora": "false"}))
    (tmp_path / "multi_lora.json").write_text(json.dumps({"a": "adapters/a"}))
    assert lora.read_config(tmp_path, tmp_path) == {}
    (tmp_path / "model.json").write_text(json.dumps({"enable_lora": True}))
    assert lora.read_config(tmp_path, Path("/project")) == {"a": Path("/project/adapters/a")}
    (tmp_path / "multi_lora.json").unlink()
    with pytest.raises(lora.AdapterError, match="multi_lora.json is missing"):
        lora.read_config(tmp_path, tmp_path)
    (tmp_path / "multi_lora.json").write_text(json.dumps(["a"]))
    with pytest.raises(lora.AdapterError, match="adapter name -> directory"):
        lora.read_config(tmp_path, tmp_path)


def test_folded_adapter_reads_divided_inputs_and_gives_divided_outputs(tmp_path):
    src = adapter(tmp_path / "src")
    scale, divisor = torch.rand(6) + 0.5, torch.rand(5) + 0.5
    assert fold_scales(src, tmp_path / "dst", {MODULE: scale}, {MODULE: divisor}) == 2
    before, after = load_file(src / lora.ADAPTER_WEIGHTS), load_file(tmp_path / "dst" / lora.ADAPTER_WEIGHTS)
    a, b = (f"base_model.model.{MODULE}.lora_{m}.weight" for m in "AB")
    x = torch.randn(3, 6)
    torch.testing.assert_close((x / scale) @ after[a].T @ after[b].T, x @ before[a].T @ before[b].T / divisor)
    for other in set(before) - {a, b}:  # unscaled modules are copied as they are
        assert torch.equal(before[other], after[other])
    assert (tmp_path / "dst" / lora.ADAPTER_CONFIG).read_text() == (src / lora.ADAPTER_CONFIG).read_text()


def test_routed_experts_gate_and_up_take_the_scale_recorded_under_their_experts_module(tmp_path):
    experts = "model.layers.0.mlp.experts"
    src = tmp_path / "src"
    src.mkdir()
    (src / lora.ADAPTER_CONFIG).write_text(json.dumps({"r": 4, "lora_alpha": 8}))
    weights = {f"base_model.model.{experts}.3.{proj}.lora_A.weight": torch.randn(4, 6)
               for proj in ("gate_proj", "up_proj", "down_proj")}
    save_file(weights, src / lora.ADAPTER_WEIGHTS)
    scale = torch.rand(6) + 0.5
    assert fold_scales(src, tmp_path / "dst", {experts: scale}, {}) == 2
    after = load_file(tmp_path / "dst" / lora.ADAPTER_WEIGHTS)
    for key, before in weights.items():  # down_proj reads act(gate) * up, which no norm scales
        torch.testing.assert_close(after[key], before * scale if "down_proj" not in key else before)


def test_prepare_folds_only_for_checkpoints_with_input_scales(tmp_path):
    listed = {"a": adapter(tmp_path / "a")}
    plain = checkpoint(tmp_path / "plain", calibrated=False)
    assert Adapters.prepare(listed, plain, tmp_path / "work", 16).paths == listed
    calibrated = checkpoint(tmp_path / "calibrated", calibrated=True)
    with pytest.raises(lora.AdapterError, match="was calibrated but has no a3b/input_scales.safetensors"):
        Adapters.prepare(listed, calibrated, tmp_path / "work", 16)
    (calibrated / INPUT_SCALES_FILE).parent.mkdir(parents=True)
    save_file({MODULE: torch.full((6,), 2.0)}, calibrated / INPUT_SCALES_FILE)
    served = Adapters.prepare(listed, calibrated, tmp_path / "work", 16).paths["a"]
    assert served == tmp_path / "work" / "a"
    key = f"base_model.model.{MODULE}.lora_A.weight"
    assert torch.equal(load_file(served / lora.ADAPTER_WEIGHTS)[key],
                       2 * load_file(listed["a"] / lora.ADAPTER_WEIGHTS)[key])


def test_prepare_refuses_what_the_profile_cannot_serve(tmp_path):
    model = checkpoint(tmp_path / "model", calibrated=False)
    with pytest.raises(lora.AdapterError, match="'big' has rank 32; the profile allows at most 16"):
        Adapters.prepare({"big": adapter(tmp_path / "big", rank=32)}, model, tmp_path / "w", 16)
    with pytest.raises(lora.AdapterError, match="'patterned' has rank 64"):
        Adapters.prepare({"patterned": adapter(tmp_path / "p", rank=8, rank_pattern={"q_proj": 64})},
                              model, tmp_path / "w", 16)
    (tmp_path / "empty").mkdir()
    with pytest.raises(lora.AdapterError, match="'empty': .* is not a PEFT adapter directory"):
        Adapters.prepare({"empty": tmp_path / "empty"}, model, tmp_path / "w", 16)


def test_lora_name_picks_an_adapter_or_is_refused_with_the_known_ones(tmp_path):
    adapters = Adapters({"sql": tmp_path / "sql", "chat": tmp_path / "chat"})
    assert adapters.request(None) is None
    chosen = adapters.request("chat")
    assert (chosen.lora_name, chosen.lora_int_id, chosen.lora_path) == ("chat", 2, str(tmp_path / "chat"))
    with pytest.raises(RequestError, match=r"'lora_name' = 'x' is not a served adapter; known: chat, sql"):
        adapters.request("x")
    with pytest.raises(RequestError, match="no LoRA adapters are served"):
        Adapters({}).request("sql")


def test_lora_name_parameter_is_a_non_empty_string():
    assert parse_sampling_json('{"lora_name": "sql"}') == {"lora_name": "sql"}
    with pytest.raises(RequestError, match="'lora_name' has value 3, which is not a string"):
        parse_sampling_json('{"lora_name": 3}')
    with pytest.raises(RequestError, match="'lora_name' = '' is out of range"):
        parse_sampling_json('{"lora_name": ""}')


def test_engine_gets_the_profile_limits_only_with_adapters():
    profile = get_profile("cpu")
    assert "enable_lora" not in profile.engine_args(Path("/p"))
    args = profile.engine_args(Path("/p"), enable_lora=True)
    assert (args["enable_lora"], args["max_lora_rank"], args["max_loras"]) == (True, 16, 4)
