"""Multi-LoRA served: a rank-8 PEFT adapter for the default model, listed in a
copy of the model repository rendered with `a3b-render --lora`, served by the
real tritonserver with the default profile. One server for this module."""
from __future__ import annotations

import concurrent.futures
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from a3b_backend.deploy import repository
from a3b_backend.bench import server_process
from a3b_backend.quant import calibrate
from a3b_backend.quant.checkpoint import INPUT_SCALES_FILE, ROW_DIVISORS_FILE
from a3b_backend.quant.dequantized import stored_tensors
from a3b_backend.quant.format import A3BConfig, A3BWeight, dequantize
from served import stream_infer, text_request, texts
from a3b_backend.profiles import PROJECT_ROOT

pytestmark = pytest.mark.served
SOURCE = PROJECT_ROOT / "models" / "smollm2-135m-instruct"
SERVED = PROJECT_ROOT / "models" / "smollm2-135m-instruct-a3b"
ADAPTER = "tiny-rank8"
GREEDY = {"temperature": 0, "max_tokens": 16}
PROMPTS = ["The capital of France is", "Once upon a time, in a small village,", "def fibonacci(n):"]
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory) -> Path:
    """Random A and B (PEFT's init_lora_weights=False), B scaled so the adapter
    moves greedy text without drowning the base model."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(SOURCE, dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS,
                                                  init_lora_weights=False))
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.mul_(0.3)
    out = tmp_path_factory.mktemp("adapter") / ADAPTER
    peft_model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def lora_server(tmp_path_factory, adapter_dir):
    repo = tmp_path_factory.mktemp("lora-repo") / "model_repository"
    shutil.copytree(PROJECT_ROOT / "model_repository", repo, ignore=shutil.ignore_patterns("__pycache__"))
    assert repository.main(["--repository", str(repo), "--lora", f"{ADAPTER}={adapter_dir}"]) == 0
    try:
        # the copy sits outside the project: the model directory is given absolute
        srv = server_process.start(tmp_path_factory.mktemp("lora-server") / "tritonserver.log",
                                   {"A3B_MODEL_REPOSITORY": str(repo), "A3B_MODEL_DIR": str(SERVED)})
    except RuntimeError as err:
        pytest.fail(str(err))
    yield srv
    srv.stop()


def served_model_unfolded():
    """transformers' model computing what the engine serves, float32: the A3B
    weights dequantized, with the AWQ input scales moved back out of the norms
    (W / s, norm * s) and out of up_proj's rows (down_proj's W / s, up_proj's
    rows * s), so it reads the inputs an adapter was trained on."""
    import json

    from transformers import AutoConfig, AutoModelForCausalLM

    config = json.loads((SERVED / "config.json").read_text())
    a3b = A3BConfig.from_json(config["quantization_config"])
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(SOURCE), dtype=torch.float32).eval()
    stored = stored_tensors(SERVED)
    scales, divisors = load_file(SERVED / INPUT_SCALES_FILE), load_file(SERVED / ROW_DIVISORS_FILE)
    # the linears of one norm share its scale
    norm_scale = {f"{calibrate.norm_for(m)}.weight": s for m, s in scales.items() if calibrate.FOLDABLE.search(m)}
    state = {}
    for name in model.state_dict():
        module = name.removesuffix(".weight")
        if f"{name}_packed" in stored:
            weight = dequantize(A3BWeight.from_tensors(stored, name), a3b)
            weight = weight / scales[module] if module in scales else weight
            state[name] = weight * divisors[module][:, None] if module in divisors else weight
        elif name in norm_scale:
            state[name] = stored[name].float() * norm_scale[name]
        elif name == "lm_head.weight":
            state[name] = stored["model.embed_tokens.weight"].float()
        else:
            state[name] = stored[name].float()
    model.load_state_dict(state)
    return model


@pytest.fixture(scope="module")
def reference(tokenizer, adapter_dir) -> dict[str, list[str]]:
    """Greedy texts of the served weights without and with the adapter merged (transformers + PEFT)."""
    from peft import PeftModel

    def greedy(model) -> list[str]:
        out = []
        for prompt in PROMPTS:
            ids = tokenizer(prompt, return_tensors="pt").input_ids
            with torch.no_grad():
                generated = model.generate(ids, max_new_tokens=GREEDY["max_tokens"], do_sample=False)
            out.append(tokenizer.decode(generated[0, ids.shape[1]:], skip_special_tokens=True))
        return out

    base = served_model_unfolded()
    base_texts = greedy(base)
    merged = PeftModel.from_pretrained(base, adapter_dir).merge_and_unload()
    return {"base": base_texts, "adapter": greedy(merged)}


def generate(server, prompt: str, lora_name: str | None = None) -> str:
    sampling = dict(GREEDY, **({"lora_name": lora_name} if lora_name else {}))
    responses, error = stream_infer(server.grpc_url, "ensemble", text_request(prompt, True, sampling, chat=False))
    assert error is None, error
    return "".join(texts(responses))


def test_adapter_answers_as_transformers_with_it_merged(lora_server, reference):
    served = [generate(lora_server, p, ADAPTER) for p in PROMPTS]
    assert served == reference["adapter"]
    assert reference["adapter"] != reference["base"]  # the adapter changes greedy text


def test_without_lora_name_the_base_model_answers(lora_server, reference):
    assert [generate(lora_server, p) for p in PROMPTS] == reference["base"]


def test_adapter_and_base_requests_batched_together(lora_server, reference):
    jobs = [(p, name) for p in PROMPTS for name in (ADAPTER, None)]
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        got = list(pool.map(lambda job: generate(lora_server, *job), jobs))
    want = [reference["adapter" if name else "base"][PROMPTS.index(p)] for p, name in jobs]
    assert got == want


def test_unknown_adapter_is_refused_with_the_known_ones(lora_server):
    sampling = dict(GREEDY, lora_name="nope")
    _, error = stream_infer(lora_server.grpc_url, "ensemble", text_request(PROMPTS[0], True, sampling))
    assert error is not None and "'lora_name' = 'nope'" in error and f"known: {ADAPTER}" in error
    assert generate(lora_server, PROMPTS[0], ADAPTER)  # still serving


def test_lora_name_on_a_server_without_adapters_is_refused(server):
    sampling = dict(GREEDY, lora_name=ADAPTER)
    _, error = stream_infer(server.grpc_url, "ensemble", text_request(PROMPTS[0], True, sampling))
    assert error is not None and "no LoRA adapters are served" in error
