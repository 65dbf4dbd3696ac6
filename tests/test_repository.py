"""The committed configs are the renderer's output, and profiles are consistent."""
import pytest

from a3b_backend import contract

from a3b_backend.deploy import repository
from a3b_backend.profiles import PROFILES, get_profile


def test_committed_configs_match_rendered():
    assert repository.main(["--check"]) == 0


def test_ensemble_declares_both_anchor_contracts():
    text = repository.render()["ensemble"]
    for name in ("text_input", "sampling_parameters", "exclude_input_in_output", "max_tokens", "min_length",
                 "stop_words", "seed", "text_output", "cum_log_probs", "num_output_tokens"):
        assert f'name: "{name}"' in text
    assert "decoupled: true" in text and "max_batch_size: 0" in text


def test_every_step_input_is_produced_upstream():
    produced = {t.name for t in contract.PREPROCESS_OUTPUTS}
    assert {t.name for t in contract.LLM_REQUEST_INPUTS} == produced
    assert {t.name for t in contract.POSTPROCESS_INPUTS} == {t.name for t in contract.LLM_OUTPUTS}


@pytest.mark.parametrize("name", sorted(PROFILES))
def test_profiles_render_engine_args(name, tmp_path):
    args = PROFILES[name].engine_args(tmp_path)
    assert args["max_model_len"] >= 8192 and args["load_format"] == "safetensors"
    assert args["trust_remote_code"] is False


def test_profile_selection(monkeypatch, tmp_path):
    monkeypatch.setenv("A3B_PROFILE", "a100x8")
    assert get_profile().tensor_parallel_size == 8
    monkeypatch.setenv("A3B_MODEL_DIR", str(tmp_path))
    assert get_profile().engine_args(tmp_path / "elsewhere")["model"] == str(tmp_path)
    monkeypatch.setenv("A3B_PROFILE", "tpu")
    with pytest.raises(ValueError, match="unknown profile 'tpu'"):
        get_profile()
