"""`make compare-quant`'s size accounting on the committed default checkpoints and its checkpoint cache (no engine)."""
import sys

import pytest

from a3b_backend.profiles import PROJECT_ROOT
from a3b_backend.quant.quality import REGISTERS

sys.path.insert(0, str(PROJECT_ROOT / "perf" / "quant_compare"))

import compare  # noqa: E402


def test_bits_per_weight_count_every_stored_tensor_of_the_quantized_layers():
    bits, weights = compare.linear_bits(compare.BF16_DIR)
    # SmolLM2-135M: 30 layers of q/o (576x576), k/v (192x576), gate/up/down (1536x576)
    assert bits == 16.0 and weights == 30 * (2 * 576 * 576 + 2 * 192 * 576 + 3 * 1536 * 576)
    a3b_bits, _ = compare.linear_bits(PROJECT_ROOT / "models" / "smollm2-135m-instruct-a3b")
    # the served default, 1x128 blocks, with every metadata tensor
    assert a3b_bits == pytest.approx(4.25, abs=0.01)


def test_evaluation_windows_cover_the_tokens_once_per_register(tokenizer):
    by_register = compare.eval_windows(tokenizer)
    assert list(by_register) == list(REGISTERS)
    for windows in by_register.values():
        assert sum(len(w) - 1 for w in windows) == compare.EVAL_TOKENS
        assert all(a[-1] == b[0] for a, b in zip(windows, windows[1:]))


def test_the_report_gives_each_register_and_redraws_a_run_before_the_prose_register():
    row = {"variant": "bf16", "peer_kernel": None, "bits_per_weight": 16.0, "linear_resident_bytes": 0,
           "kernels": ["bf16"], "greedy_tokens": [[1, 2]], "decode": [10.0], "ttft": [0.1]}
    now = {**row, "perplexity": {register: 10.0 + i for i, register in enumerate(REGISTERS)}}
    before = {**row, "perplexity": 12.0}
    assert all(f"perplexity, {register}" in compare.markdown([now]) for register in REGISTERS)
    assert "| 12.00 | +0.0% |" in compare.markdown([before]) and "prose" not in compare.markdown([before])


def test_a_checkpoint_is_rebuilt_when_its_command_or_the_calibration_text_changes(tmp_path):
    out = tmp_path / "ckpt"
    writes = f"import pathlib; p = pathlib.Path({str(out)!r}); p.mkdir(); (p / 'config.json').write_text('{{}}')"
    calibration = tmp_path / "calibration.txt"
    variant = compare.Variant("toy", out, [sys.executable, "-c", writes, "--calibration", str(calibration)])
    calibration.write_text("one text")
    assert compare.build(variant, calibration) is not None
    assert compare.build(variant, calibration) is None  # built the same way already
    calibration.write_text("another text")
    assert compare.build(variant, calibration) is not None
    changed = compare.Variant("toy", out, [*variant.build, "--changed"])
    assert compare.build(changed, calibration) is not None
    assert compare.build(changed, calibration) is None


def test_a_checkpoint_whose_command_reads_no_calibration_survives_a_new_calibration_text(tmp_path):
    out = tmp_path / "ckpt"
    writes = f"import pathlib; p = pathlib.Path({str(out)!r}); p.mkdir(); (p / 'config.json').write_text('{{}}')"
    calibration = tmp_path / "calibration.txt"
    calibration.write_text("one text")
    uncalibrated = compare.Variant("toy", out, [sys.executable, "-c", writes])
    reading = compare.Variant("toy", tmp_path / "other", [sys.executable, "-c", writes.replace("ckpt", "other"),
                                                          "--calibration", str(calibration)])
    assert compare.build(uncalibrated, calibration) is not None and compare.build(reading, calibration) is not None
    calibration.write_text("another text")
    assert compare.build(uncalibrated, calibration) is None
    assert compare.build(reading, calibration) is not None
