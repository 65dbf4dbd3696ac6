"""make model-qwen: Qwen3.6-35B-A3B's text architecture at toy width, random
weights (fixed seed), written in the real checkpoint's layout.

    python -m a3b_backend.prepare.qwen_tiny --out models/qwen3.6-tiny

What is Qwen3.6's (its config.json, `text_config` of `Qwen3_5MoeForConditionalGeneration`,
model_type `qwen3_5_moe`): the layer pattern (3 Gated DeltaNet layers, then one
gated full-attention layer; `full_attention_interval` 4), full attention with
head_dim 256, 2 KV heads, an output gate, q/k norms, partial rotary factor
0.25 and rope theta 1e7; DeltaNet heads of dim 128 with twice as many value as
key heads and a causal conv of kernel 4; routed experts (top 8) beside one
gated shared expert; zero-centred RMSNorms; untied embeddings; one MTP layer.
What is scaled down: width (hidden 256 for 2048), depth (8 layers for 40),
heads (4 Q / 2 KV, DeltaNet 4 QK / 8 V for 16 / 32), experts (32 for 256,
intermediate 128 for 512) and the vocabulary (Qwen3's 151,643-rank BPE from
the `dashscope` package with Qwen3.6's special-token strings, 151,936 rows, for
Qwen3.6's 248,320).

The layout is the real checkpoint's: the text model under
`model.language_model.`, routed experts stacked per layer
(`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj` [E, H, I]) and an
`mtp.*` layer, so `a3b-quantize` converts it by the path the real model takes.

Random weights give near-equal logits: with transformers' default init the
top logits of 151,936 are within float noise of each other, and greedy
decoding compares noise. The LM head is scaled so the logits of a probe
prompt have a standard deviation of LOGIT_STD (4): the top-two gap is then
typically ~0.8 (the spread of the largest of that many Gaussians), far above
float32 differences between vLLM and transformers. It is not above bf16's
rounding of the logits themselves (8 significant bits, a 0.125 grid near 20)
on every step, and no rescaling can be (the rounding is relative):
tests/test_served_qwen.py allows a batch to break such a tie differently.
"""
from __future__ import annotations

import argparse
import json
import re
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from a3b_backend.prepare.chat_templates import QWEN36_CHAT_TEMPLATE
from a3b_backend.prepare.qwen_vocab import QWEN_PATTERN, vocab_file
from a3b_backend.quant import checkpoint

SEED = 0
LOGIT_STD = 4.0
DONE_MARKER = ".prepared"
LAYERS = 8
TEXT_CONFIG = dict(
    hidden_size=256, num_hidden_layers=LAYERS, full_attention_interval=4,
    layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(LAYERS)],
    num_attention_heads=4, num_key_value_heads=2, head_dim=256, attn_output_gate=True,
    partial_rotary_factor=0.25, rope_parameters={"rope_type": "default", "rope_theta": 1e7,
                                                 "partial_rotary_factor": 0.25},
    linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=128, linear_value_head_dim=128,
    linear_conv_kernel_dim=4,
    num_experts=32, num_experts_per_tok=8, moe_intermediate_size=128, shared_expert_intermediate_size=128,
    vocab_size=151936, max_position_embeddings=262144, tie_word_embeddings=False, rms_norm_eps=1e-6,
    mtp_num_hidden_layers=1, dtype="bfloat16",
)
# Qwen3.6-35B-A3B's text config where TEXT_CONFIG scales it down (its published config.json)
FULL_SIZE = dict(hidden_size=2048, num_hidden_layers=40, num_attention_heads=16, num_key_value_heads=2,
                 linear_num_key_heads=16, linear_num_value_heads=32, num_experts=256, moe_intermediate_size=512,
                 shared_expert_intermediate_size=512, vocab_size=248320)
# Qwen3's special tokens, in id order from the end of the BPE ranks: the strings Qwen3.6 uses.
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
                  "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
                  "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>",
                  "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
                  "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>", "<think>", "</think>"]
EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def build_tokenizer(out: Path):
    """Qwen's BPE from `dashscope` as a Hugging Face fast tokenizer, with Qwen3.6's template."""
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    backend = TikTokenConverter(vocab_file=str(vocab_file()), pattern=QWEN_PATTERN,
                                extra_special_tokens=SPECIAL_TOKENS).converted()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                        additional_special_tokens=SPECIAL_TOKENS[1:], model_max_length=262144)
    tokenizer.chat_template = QWEN36_CHAT_TEMPLATE
    tokenizer.save_pretrained(out)
    return tokenizer


def random_model(tokenizer):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("qwen3_5_moe_text", **TEXT_CONFIG, bos_token_id=None,
                                  eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
                                  pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_config(config).eval()
    probe = torch.tensor([tokenizer.encode("The capital of France is Paris. Experts route tokens.")])
    with torch.no_grad():
        std = model(probe).logits.float().std().item()
        model.lm_head.weight.mul_(LOGIT_STD / std)
    return model.to(torch.bfloat16)


def real_layout(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' per-expert, unprefixed tensors -> the published checkpoint's names:
    text model under model.language_model., experts stacked, plus an MTP layer."""
    out, experts = {}, {}
    for name, tensor in tensors.items():
        match = EXPERT.match(name)
        if match:
            experts.setdefault(match[1], {}).setdefault(match[3], {})[int(match[2])] = tensor
        else:
            out[name.replace("model.", "model.language_model.", 1) if name.startswith("model.") else name] = tensor
    for prefix, projections in experts.items():
        stacked = {proj: torch.stack([per[e] for e in sorted(per)]) for proj, per in projections.items()}
        base = prefix.replace("model.", "model.language_model.", 1)
        out[f"{base}.gate_up_proj"] = torch.cat([stacked["gate_proj"], stacked["up_proj"]], dim=1)
        out[f"{base}.down_proj"] = stacked["down_proj"]
    out.update(mtp_layer(tensors))
    return out


def mtp_layer(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One multi-token-prediction layer (the real checkpoint's `mtp.*`): a full-attention
    decoder layer plus the fusion of embedding and hidden state. Carried, not served."""
    last = f"model.layers.{LAYERS - 1}."
    layer = {f"mtp.layers.0.{n[len(last):]}": t.clone() for n, t in tensors.items()
             if n.startswith(last) and not EXPERT.match(n)}
    hidden = TEXT_CONFIG["hidden_size"]
    g = torch.Generator().manual_seed(SEED + 1)
    fusion = {"mtp.fc.weight": (torch.randn(hidden, 2 * hidden, generator=g) * 0.02).to(torch.bfloat16),
              **{f"mtp.{n}.weight": torch.zeros(hidden, dtype=torch.bfloat16)
                 for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")}}
    return {**layer, **fusion}


def build(out: Path) -> Path:
    if (out / DONE_MARKER).exists():
        print(f"model ready: {out}")
        return out
    with checkpoint.building(out) as partial, tqdm(total=4, desc="building qwen3.6-tiny", unit="step") as bar:
        bar.set_postfix_str("tokenizer (Qwen BPE, 151K ranks)")
        tokenizer = build_tokenizer(partial)
        bar.update()
        bar.set_postfix_str("random weights")
        model = random_model(tokenizer)
        bar.update()
        bar.set_postfix_str("saving")
        with tempfile.TemporaryDirectory() as tmp:
            model.save_pretrained(tmp)
            tensors = {}
            for shard in sorted(Path(tmp).glob("*.safetensors")):
                tensors.update(load_file(shard))
            config = json.loads((Path(tmp) / "config.json").read_text())
        bar.update()
        bar.set_postfix_str("re-saving in the published layout")
        save_file(real_layout(tensors), partial / "model.safetensors", metadata={"format": "pt"})
        (partial / "config.json").write_text(json.dumps(config, indent=2))
        bar.update()
        (partial / DONE_MARKER).write_text("")
    print(f"model ready: {out}")
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("models/qwen3.6-tiny"))
    build(parser.parse_args(argv).out)


if __name__ == "__main__":
    main()
