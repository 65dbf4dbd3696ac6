"""Activation statistics from real text, and the activation-aware transform they drive.

For every quantized linear layer we record the mean square and mean absolute
value of each input channel over calibration text. Two uses:
- importance weights for the fit (mean x^2 per column: the diagonal of the
  layer's input Hessian, so the fit minimizes output error, not weight error);
- an AWQ-style per-channel scale s = mean|x|^alpha that enlarges salient
  columns before quantizing; W ~ Q(W diag(s)) diag(1/s), alpha searched per
  layer group for the lowest output error. Only where 1/s folds
  into the preceding RMSNorm (q/k/v after input_layernorm, gate/up after
  post_attention_layernorm, which share their input and so their s), and for
  down_proj, whose input act(gate) * up is divided by s when up_proj's rows
  are (a row factor that A3B's per-row table scales hold exactly in 1xC
  blocks); other layers get the importance weighting alone, so no runtime op
  is needed.

Routed experts get statistics of their own: the model routes each token as it
serves (its router's top-k), and a hook on the experts module records, for
every expert, the tokens routed to it (its gate/up input) and its own
intermediate activations act(gate) * up (its down_proj input). An expert that
saw fewer than MIN_EXPERT_TOKENS tokens falls back to its MoE block's
statistics: the block's input over all tokens for gate/up, the pooled
intermediate activations of the block's experts for down_proj
(`fill_expert_fallbacks`, which counts them).
"""
from __future__ import annotations

import ast
import dataclasses
import functools
import importlib.metadata
import random
import re
import sysconfig
from pathlib import Path
from typing import Callable

import torch
from tqdm import tqdm

from a3b_backend.profiles import LICENCE_TEXTS
from a3b_backend.quant.names import OUTSIDE_TEXT_MODEL

# Linear layers quantized by default; embeddings, norms, lm_head and MoE routers stay.
# (Gated DeltaNet's small in_proj_a/in_proj_b gate projections stay too.)
QUANTIZED = re.compile(
    r"\.layers\.\d+\..*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj|in_proj_qkvz|in_proj_qkv|"
    r"in_proj_z|out_proj)$"
)
# An expert's statistics stand on their own from this many routed tokens.
MIN_EXPERT_TOKENS = 16


def is_quantized(module: str) -> bool:
    return bool(QUANTIZED.search(module)) and not OUTSIDE_TEXT_MODEL.match(module)

ALPHAS = (0.0, 0.25, 0.5, 0.75)
# Quantized linears whose input comes straight from an RMSNorm, whose weight can absorb 1/s; they
# share one scale per norm, searched on them. Every other reader of that norm takes s into its
# input columns too, so that the fold changes nothing but the rounding: the unquantized ones
# (READERS: MoE routers, the shared expert's gate, Gated DeltaNet's a/b projections) as stored,
# and a MoE block's routed experts before they are rounded. A MoE block without a shared expert
# (Qwen3-MoE) has no linear to search the scale on: its norm is not folded.
FOLDABLE = re.compile(r"\.layers\.\d+\.(self_attn\.(q_proj|k_proj|v_proj)"
                      r"|linear_attn\.(in_proj_qkvz|in_proj_qkv|in_proj_z)"
                      r"|mlp\.(shared_expert\.)?(gate_proj|up_proj))$")
READERS = re.compile(r"\.layers\.\d+\.(linear_attn\.(in_proj_ba|in_proj_a|in_proj_b)|mlp\.(gate|shared_expert_gate))$")
ROUTED_EXPERTS = re.compile(r"\.layers\.\d+\.mlp\.experts$")
NORM_OF = {"self_attn": "input_layernorm", "linear_attn": "input_layernorm", "mlp": "post_attention_layernorm"}
# A dense or shared-expert MLP's down_proj: up_proj's rows absorb 1/s (routed
# experts' down projections have no importance statistics of their own).
ROW_FOLDABLE = re.compile(r"^(.*\.layers\.\d+\.mlp(?:\.shared_expert)?)\.down_proj$")


def norm_for(module: str) -> str:
    """The RMSNorm that feeds a decoder layer's module (a foldable linear, one of READERS, or
    its routed experts), whose weight absorbs their AWQ scale."""
    match = re.match(r"^(.*\.layers\.\d+)\.(self_attn|linear_attn|mlp)\.", module)
    if match is None:
        raise ValueError(f"{module} is not read from a decoder layer's RMSNorm")
    return f"{match.group(1)}.{NORM_OF[match.group(2)]}"


def reads_folded_norm(module: str) -> bool:
    """An unquantized linear or routed experts that read a foldable group's norm (take s as stored)."""
    return bool(READERS.search(module) or ROUTED_EXPERTS.search(module))


@dataclasses.dataclass
class ChannelStats:
    sq_sum: torch.Tensor
    abs_sum: torch.Tensor
    count: int = 0
    gram: torch.Tensor | None = None  # sum of x x^T, when collected with hessians=True

    @property
    def hessian(self) -> torch.Tensor:
        """E[x x^T] over the calibration tokens (GPTQ's H, up to a factor)."""
        if self.gram is None:
            raise ValueError("statistics were collected without hessians=True")
        return self.gram / max(self.count, 1)

    @property
    def importance(self) -> torch.Tensor:
        return self.sq_sum / max(self.count, 1)

    @property
    def mean_abs(self) -> torch.Tensor:
        return self.abs_sum / max(self.count, 1)


@dataclasses.dataclass
class RoutedInputs:
    """A stacked experts module's calls: the tokens [T, hidden] and the experts each chose [T, k]."""
    hidden: list[torch.Tensor] = dataclasses.field(default_factory=list)
    chosen: list[torch.Tensor] = dataclasses.field(default_factory=list)

    def tokens(self, expert: int) -> torch.Tensor:
        """The tokens routed to `expert`, over every call."""
        return torch.cat([x[(c == expert).any(-1)] for x, c in zip(self.hidden, self.chosen)])


def awq_scale(stats: ChannelStats, alpha: float) -> torch.Tensor:
    s = stats.mean_abs.clamp_min(1e-5) ** alpha
    return s / (s.max() * s.min()).sqrt()


# (linear name, weight, input importance) -> the weight as quantized and dequantized
QuantDequant = Callable[[str, torch.Tensor, torch.Tensor], torch.Tensor]


def choose_scale(weights: dict[str, torch.Tensor], stats: ChannelStats, quant_dequant: QuantDequant) -> torch.Tensor:
    """The AWQ scale, among alpha in ALPHAS, that minimizes the output error of
    the layers sharing this input (by name): E||x (W - W_hat)^T||^2, taken with the
    diagonal of E[x x^T] (sum_j E[x_j^2] ||W[:, j] - W_hat[:, j]||^2)."""
    best, best_err = None, float("inf")
    for alpha in ALPHAS:
        s = awq_scale(stats, alpha)
        importance = stats.importance / s**2
        err = sum(float((((quant_dequant(name, w * s, importance) / s) - w) ** 2 * stats.importance).sum())
                  for name, w in weights.items())
        if err < best_err:
            best, best_err = s, err
    return best


def moe_blocks(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """Sparse MoE blocks (a module holding `experts`), outside what stays unquantized."""
    return {n: m for n, m in model.named_modules() if hasattr(m, "experts") and not OUTSIDE_TEXT_MODEL.match(n)}


def stacked_experts(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """Routed experts kept as 3-D parameters (transformers 5.x: gate_up_proj [E, 2I, H], down_proj [E, H, I])."""
    return {n: m for n, m in model.named_modules()
            if getattr(getattr(m, "gate_up_proj", None), "ndim", 0) == 3 and not OUTSIDE_TEXT_MODEL.match(n)}


def groups(names: list[str]) -> dict[str, list[str]]:
    """Foldable linears grouped by the RMSNorm that feeds them (they share one scale)."""
    out: dict[str, list[str]] = {}
    for name in names:
        if FOLDABLE.search(name):
            out.setdefault(norm_for(name), []).append(name)
    return out


def row_folds(names: list[str]) -> dict[str, str]:
    """down_proj -> the up_proj whose rows absorb its AWQ scale, where both are quantized."""
    out, present = {}, set(names)
    for name in names:
        match = ROW_FOLDABLE.match(name)
        if match and f"{match.group(1)}.up_proj" in present:
            out[name] = f"{match.group(1)}.up_proj"
    return out


def quantized_linears(model: torch.nn.Module, prefix: str = "") -> dict[str, torch.nn.Linear]:
    """The linears A3B quantizes, by name within `model` (`prefix`: the model's own name, for the pattern)."""
    return {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and is_quantized(prefix + n)}


@torch.no_grad()
def collect(model: torch.nn.Module, token_ids: torch.Tensor, seq_len: int = 512,
            hessians: bool = False) -> dict[str, ChannelStats]:
    """Run the model over token_ids in windows of seq_len; input channel statistics per quantized
    linear, per MoE block and per routed expert (with hessians=True, each linear's full E[x x^T] too)."""
    def run() -> None:
        for start in tqdm(range(0, token_ids.numel(), seq_len), desc="calibrating", unit="window", leave=False):
            model(token_ids[start:start + seq_len].unsqueeze(0))

    return record(model, run, hessians)


@torch.no_grad()
def record(module: torch.nn.Module, run: Callable[[], object], hessians: bool = False,
           prefix: str = "", routed: dict[str, RoutedInputs] | None = None,
           every_expert: bool = False) -> dict[str, ChannelStats]:
    """The statistics `collect` gathers, of `module`'s linears, MoE blocks and experts while `run()`
    runs it; keys are their names within `module` after `prefix` (a decoder layer: its own name).
    `routed`: filled with each stacked experts module's calls, by the same names. `every_expert`:
    each routed expert's statistics (and `routed`) as if every token had been sent to it, as
    llm-compressor's option to calibrate all experts does; the layer's output stays the model's."""
    stats: dict[str, ChannelStats] = {}
    # q/k/v (and gate/up) read the same input tensor: its x^T x is computed once
    last_gram: dict[str, torch.Tensor] = {}

    def add(name: str, x: torch.Tensor, gram: torch.Tensor | None = None) -> ChannelStats:
        st = stats.setdefault(name, ChannelStats(torch.zeros(x.shape[1]), torch.zeros(x.shape[1]),
                                                 gram=None if gram is None else torch.zeros_like(gram)))
        st.sq_sum += (x * x).sum(0)
        st.abs_sum += x.abs().sum(0)
        st.count += x.shape[0]
        if gram is not None:
            st.gram += gram
        return st

    def record_linear(_mod, args, _out, name, gram):
        x = args[0].detach().float().reshape(-1, args[0].shape[-1])
        if gram and last_gram.get("input") is not args[0]:
            last_gram.update(input=args[0], gram=x.T @ x)
        add(name, x, last_gram["gram"] if gram else None)

    def record_experts(experts, args, _out, name):
        """Each expert's inputs as the model routes them: gate/up read the tokens sent to it,
        down_proj its own act(gate) * up."""
        x = args[0].detach().float().reshape(-1, args[0].shape[-1])
        chosen = args[1].reshape(x.shape[0], -1)
        if every_expert:
            chosen = torch.arange(experts.gate_up_proj.shape[0], device=chosen.device).expand(x.shape[0], -1)
        if routed is not None:
            calls = routed.setdefault(name, RoutedInputs())
            calls.hidden.append(x)
            calls.chosen.append(chosen)
        for e in chosen.unique().tolist():
            if e >= experts.gate_up_proj.shape[0]:  # transformers' marker of a dropped slot
                continue
            tokens = x[(chosen == e).any(-1)]
            gate_up = add(f"{name}.{e}.gate_proj", tokens)
            stats[f"{name}.{e}.up_proj"] = gate_up  # one input, one record
            gate, up = torch.nn.functional.linear(tokens, experts.gate_up_proj[e].float()).chunk(2, dim=-1)
            add(f"{name}.{e}.down_proj", experts.act_fn(gate) * up)

    hooks = [m.register_forward_hook(functools.partial(record_linear, name=prefix + name, gram=hessians))
             for name, m in quantized_linears(module, prefix).items()]
    hooks += [m.register_forward_hook(functools.partial(record_linear, name=prefix + name, gram=False))
              for name, m in moe_blocks(module).items()]
    hooks += [m.register_forward_hook(functools.partial(record_experts, name=prefix + name))
              for name, m in stacked_experts(module).items()]
    try:
        run()
    finally:
        for h in hooks:
            h.remove()
    return stats


def fill_expert_fallbacks(stats: dict[str, ChannelStats], model: torch.nn.Module, prefix: str = "") -> int:
    """Give each routed expert that saw fewer than MIN_EXPERT_TOKENS tokens its MoE block's
    statistics (gate/up: the block's input; down_proj: its experts' intermediate activations
    pooled); -> how many experts fell back. `prefix`: as for `record`."""
    fallbacks = 0
    for name, experts in ((prefix + n, m) for n, m in stacked_experts(model).items()):
        block = stats[name.rsplit(".", 1)[0]]
        downs = [st for e in range(experts.gate_up_proj.shape[0]) if (st := stats.get(f"{name}.{e}.down_proj"))]
        pooled = ChannelStats(sum(st.sq_sum for st in downs), sum(st.abs_sum for st in downs),
                              sum(st.count for st in downs)) if downs else None
        for e in range(experts.gate_up_proj.shape[0]):
            own = stats.get(f"{name}.{e}.gate_proj")
            if own is not None and own.count >= MIN_EXPERT_TOKENS:
                continue
            fallbacks += 1
            stats[f"{name}.{e}.gate_proj"] = stats[f"{name}.{e}.up_proj"] = block
            width = experts.down_proj.shape[-1]
            stats[f"{name}.{e}.down_proj"] = pooled or ChannelStats(torch.ones(width), torch.ones(width), 1)
    return fallbacks


def load_text(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


DOCUMENT_CHARS = 2500  # about 600 tokens: most 512-token windows start in a document the last did not see
PROSE_PARAGRAPH_CHARS = 200
# Standard-library folders whose text is not prose or is another register (tests, the language reference)
NOT_PROSE = {"test", "tests", "idlelib", "lib2to3", "pydoc_data", "site-packages", "dist-packages", "turtledemo",
             "ensurepip", "venv"}
# The installed distribution that is this project: its docstrings change with every commit
PROJECT_DISTRIBUTION = "a3b-triton"


def docstring_prose(path: Path) -> list[str]:
    """The prose paragraphs of a Python file's docstrings (module, class and function), each on one
    line, in the file's order: those of PROSE_PARAGRAPH_CHARS characters or more that are at least
    90% letters, spaces and punctuation. None from a file that does not parse."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
        return []
    paragraphs = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            for paragraph in re.split(r"\n\s*\n", ast.get_docstring(node) or ""):
                body = " ".join(line.strip() for line in paragraph.splitlines())
                if (len(body) >= PROSE_PARAGRAPH_CHARS
                        and sum(c.isalpha() or c in " ,.;'" for c in body) >= 0.9 * len(body)):
                    paragraphs.append(body)
    return paragraphs


@functools.cache
def stdlib_prose() -> tuple[str, ...]:
    """The standard library's docstring prose, file by file in path order, tests and the folders
    of NOT_PROSE left out: the prose held-out register's source, which calibration never reads."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return tuple(paragraph for path in sorted(root.rglob("*.py")) if not NOT_PROSE & set(path.relative_to(root).parts)
                 for paragraph in docstring_prose(path))


def package_prose(distribution: importlib.metadata.Distribution, held_out: set[str]) -> str:
    """One installed distribution's docstring prose, its Python files (tests left out) in path order,
    up to DOCUMENT_CHARS, with no paragraph of `held_out`."""
    files = sorted(str(f) for f in distribution.files or ()
                   if f.suffix == ".py" and not {"test", "tests"} & set(f.parts))
    paragraphs, chars = [], 0
    for file in files:
        for paragraph in docstring_prose(Path(distribution.locate_file(file))):
            if paragraph not in held_out:
                paragraphs.append(paragraph)
                chars += len(paragraph) + 2
        if chars >= DOCUMENT_CHARS:
            break
    return "\n\n".join(paragraphs)


def broad_calibration_documents() -> list[str]:
    """Calibration documents of more than one register: the licence texts Debian and Ubuntu ship,
    and per installed Python package (this project's left out) its long description (README:
    technical English, markdown, reStructuredText, code examples) and the English prose of its
    docstrings (no paragraph the standard library's docstrings hold: those are the prose held-out
    register). Each is cut to DOCUMENT_CHARS, in one fixed shuffled order (every tool and run reads
    the same text)."""
    licences = (sorted(p for p in LICENCE_TEXTS.iterdir() if p.is_file() and not p.is_symlink())
                if LICENCE_TEXTS.is_dir() else [])
    documents = [load_text(p) for p in licences]
    distributions = {d.metadata["Name"].lower(): d for d in importlib.metadata.distributions()}
    distributions.pop(PROJECT_DISTRIBUTION, None)
    held_out = set(stdlib_prose())
    for name in sorted(distributions):
        readme = distributions[name].metadata.json.get("description", "")
        prose = package_prose(distributions[name], held_out)
        documents += [text for text in (readme, prose) if len(text) >= DOCUMENT_CHARS // 2]
    random.Random(0).shuffle(documents)
    return [document[:DOCUMENT_CHARS] for document in documents]


def broad_calibration_text() -> str:
    """The built-in calibration documents as one text."""
    return "\n\n".join(broad_calibration_documents())


QUESTION_CHARS = 200


def chat_calibration_text(tokenizer) -> str:
    """The built-in calibration documents, each as one exchange in the model's chat template: the
    user sends its first line (at most QUESTION_CHARS characters), the assistant answers with the
    rest. Calibration then also covers the positions a chat model serves from, its answer after the
    template's assistant turn, which the plain text never shows it."""
    exchanges = []
    for document in broad_calibration_documents():
        document = document.strip()
        first, _, rest = document.partition("\n")
        if not rest.strip():  # one line: cut it
            first, rest = document[:QUESTION_CHARS], document[QUESTION_CHARS:]
        exchanges.append(tokenizer.apply_chat_template(
            [{"role": "user", "content": first.strip()[:QUESTION_CHARS]}, {"role": "assistant", "content": rest.strip()}],
            tokenize=False))
    return "".join(exchanges)
