"""How far each way of running the projections moves SmolLM2's logits from
transformers' fp32 model, on chat prompts: mean KL(fp32 || ours) per token and
top-1 agreement. Covers what we ship (bf16, the lossless 4/8-bit path, which
matches bf16 when every row takes it) and what we measured and did not ship
(int8 weights and dynamic per-token int8 activations, as torch._int_mm would
run them), and the shipped int8 activations per group of 32 (qgemm_vnni.c, where
the CPU has VNNI), with qkv's activations at 14 bits (shipped for steps of up
to linear.FINE_ROWS rows), int8 (shipped beyond) or exact. Simulated in fp32
beside them: int8 activations per group of 32 with each group's own scale (the
shipped numerics) and with scales that are the row's divided by a power of two
(round AL's lead: 2 FMAs a row and group in place of 3).
Run: .venv/bin/python bench/quant_accuracy.py ["fp32, int8 act. per group" ...]"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from test_model import TEXTS, all_logits, reference_logits  # noqa: E402

from pipeline.models import DEFAULT_MODEL, resolve_model  # noqa: E402
from workers.scheduler import qgemm_vnni  # noqa: E402
from workers.scheduler.linear import Dense, Kernels, make_linear  # noqa: E402
from workers.scheduler.model import LlamaModel, read_spec  # noqa: E402

PROJECTIONS = ("qkv", "o", "gate_up", "down")


def int8_rows(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Round to 255 levels per slice along `dim` (symmetric), back to float."""
    scale = t.abs().amax(dim, keepdim=True).clamp(min=1e-8) / 127
    return torch.round(t / scale) * scale


def int8_groups(x: torch.Tensor, pow2: bool, max_shift: int = 6) -> torch.Tensor:
    """Round each group of 32 along the last dim to 255 levels, back to float: its
    own scale (max |x| / 127), or (`pow2`) the row's largest group's scale divided by
    the power of two (at most 2^max_shift) that keeps the group within 127 levels."""
    groups = x.reshape(*x.shape[:-1], -1, 32)
    amax = groups.abs().amax(-1, keepdim=True).clamp(min=1e-8)
    scale = amax / 127
    if pow2:
        row = amax.amax(-2, keepdim=True)
        shift = torch.floor(torch.log2(row / amax)).clamp(0, max_shift)
        scale = row / 127 / 2 ** shift
    return (torch.round(groups / scale).clamp(-127, 127) * scale).reshape(x.shape)


class Grouped:
    """A projection whose activations are int8_groups-rounded, computed in fp32."""

    def __init__(self, dense: Dense, pow2: bool):
        self.weight_t, self.pow2 = dense.weight_t, pow2

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return int8_groups(x, self.pow2) @ self.weight_t


CALIBRATION = ["Tell me a story about a dragon who learns to cook.",
               "Translate 'good morning' into French and German.",
               "Summarize the causes of the French revolution in three sentences."]


class Simulated:
    """A projection with int8 weights (per output channel) and/or int8
    activations (per token), computed in fp32: the numerics of W8A8. With
    `smooth` (per input channel), SmoothQuant's x / s times s * W."""

    def __init__(self, dense: Dense, weights: bool, activations: bool,
                 smooth: torch.Tensor | None = None):
        self.smooth = smooth
        weight_t = dense.weight_t if smooth is None else dense.weight_t * smooth[:, None]
        self.weight_t = int8_rows(weight_t, 0) if weights else weight_t
        self.activations = activations

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.smooth is not None:
            x = x / self.smooth
        return (int8_rows(x, -1) if self.activations else x) @ self.weight_t


class Recorder:
    """Passes through, keeping each input channel's largest |x|."""

    def __init__(self, dense: Dense):
        self.dense, self.amax = dense, None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        amax = x.abs().amax(0)
        self.amax = amax if self.amax is None else torch.maximum(self.amax, amax)
        return self.dense(x)


def distance(mine: list[torch.Tensor], theirs: list[torch.Tensor]) -> tuple[float, float]:
    kl, agree = [], []
    for m, t in zip(mine, theirs, strict=True):
        log_p, log_q = torch.log_softmax(t, -1), torch.log_softmax(m.float(), -1)
        kl.append((log_p.exp() * (log_p - log_q)).sum(-1).mean().item())
        agree.append((m.argmax(-1) == t.argmax(-1)).float().mean().item())
    return sum(kl) / len(kl), sum(agree) / len(agree)


def main() -> None:
    path = resolve_model(DEFAULT_MODEL).path
    tokenizer = AutoTokenizer.from_pretrained(path)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                             add_generation_prompt=True,
                                             tokenize=True)["input_ids"] for text in TEXTS]
    reference = reference_logits(AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32), prompts)
    spec, cpu = read_spec(path), torch.device("cpu")
    variants = {
        "bf16 (shipped)": lambda: LlamaModel.load(path, spec, cpu, torch.bfloat16),
        "bf16 + lossless 4/8-bit, every row (shipped)": lambda: lossless_everywhere(path, spec),
        "bf16 + int8 act., qkv 14-bit (shipped <= 4 rows)": lambda: vnni(path, spec, "fine"),
        "bf16 + int8 act., qkv too (shipped > 4 rows)": lambda: vnni(path, spec, "int8"),
        "bf16 + int8 act., qkv exact (VNNI)": lambda: vnni(path, spec, "exact"),
        "fp32, int8 weights": lambda: simulated(path, spec, weights=True, activations=False),
        "fp32, int8 activations": lambda: simulated(path, spec, weights=False, activations=True),
        "fp32, W8A8": lambda: simulated(path, spec, weights=True, activations=True),
        "fp32, W8A8 SmoothQuant alpha 0.5": lambda: smoothquant(path, spec, tokenizer, 0.5),
        "fp32, int8 act. per group of 32": lambda: grouped(path, spec, pow2=False),
        "fp32, int8 act. per group, power-of-2 scales": lambda: grouped(path, spec, pow2=True),
    }
    if len(sys.argv) > 1:  # names' starts: only those (the reference is always made)
        variants = {name: build for name, build in variants.items()
                    if any(name.startswith(prefix) for prefix in sys.argv[1:])}
    print(f"{'variant':<50} {'mean KL':>8} {'top-1 agree':>12}")
    with torch.inference_mode():
        for name, build in variants.items():
            model = build()
            if model is None:
                print(f"{name:<50} {'(no kernel on this CPU)':>21}")
                continue
            kl, agree = distance(all_logits(model, prompts), reference)
            print(f"{name:<50} {kl:8.4f} {agree:12.3f}", flush=True)


def lossless_everywhere(path: Path, spec) -> LlamaModel:
    model = LlamaModel.load(path, spec, torch.device("cpu"), torch.bfloat16, "lossless")
    for linear in [model.lm_head] + [getattr(layer, name) for layer in model.layers
                                     for name in PROJECTIONS]:
        if type(linear) is not Dense:  # the 4/8-bit kernels even for the whole prompt
            linear.small_batch = 1 << 30
    return model


def vnni(path: Path, spec, qkv: str) -> LlamaModel | None:
    """The real kernel (qgemm_vnni.c) on every row; `qkv`: that projection's
    activations, "fine" (14 bits), "int8" or "exact" (bf16)."""
    if qgemm_vnni.load() is None:
        return None
    kernels = Kernels(onednn=True, vnni=True)
    model = LlamaModel.load(path, spec, torch.device("cpu"), torch.bfloat16, "lossless", kernels)
    if qkv == "exact":  # rebuilt from the checkpoint without the model's fine flag
        file = next(path.glob("*.safetensors"))
        with safe_open(str(file), framework="pt") as f:
            for i, layer in enumerate(model.layers):
                weight = torch.cat([f.get_tensor(f"model.layers.{i}.self_attn.{n}_proj.weight")
                                    for n in "qkv"])
                layer.qkv = make_linear(weight, None, torch.bfloat16, "lossless",
                                        Kernels(onednn=True, qgemm=True))
    for layer in model.layers:  # a whole prompt is one step: its rows take one kernel
        layer.qkv.fine_rows = 1 << 30 if qkv == "fine" else -1
    for linear in [model.lm_head] + [getattr(layer, name) for layer in model.layers
                                     for name in PROJECTIONS]:
        if type(linear) is not Dense:  # the narrow kernels even for the whole prompt
            linear.small_batch = 1 << 30
    return model


def simulated(path: Path, spec, weights: bool, activations: bool) -> LlamaModel:
    model = LlamaModel.load(path, spec, torch.device("cpu"), torch.float32)
    for layer in model.layers:
        for name in PROJECTIONS:
            setattr(layer, name, Simulated(getattr(layer, name), weights, activations))
    return model


def grouped(path: Path, spec, pow2: bool) -> LlamaModel:
    model = LlamaModel.load(path, spec, torch.device("cpu"), torch.float32)
    for layer in model.layers:
        for name in PROJECTIONS:
            setattr(layer, name, Grouped(getattr(layer, name), pow2))
    return model


def smoothquant(path: Path, spec, tokenizer, alpha: float) -> LlamaModel:
    """Scales from activation maxima on other prompts than the measured ones."""
    model = LlamaModel.load(path, spec, torch.device("cpu"), torch.float32)
    for layer in model.layers:
        for name in PROJECTIONS:
            setattr(layer, name, Recorder(getattr(layer, name)))
    all_logits(model, [tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True,
        tokenize=True)["input_ids"] for text in CALIBRATION])
    for layer in model.layers:
        for name in PROJECTIONS:
            recorded = getattr(layer, name)
            weight_max = recorded.dense.weight_t.abs().amax(1).clamp(min=1e-5)
            smooth = recorded.amax.clamp(min=1e-5) ** alpha / weight_max ** (1 - alpha)
            setattr(layer, name, Simulated(recorded.dense, True, True, smooth))
    return model


if __name__ == "__main__":
    main()
