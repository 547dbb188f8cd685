# Our forward pass for Llama-family decoders (Llama, SmolLM2, Qwen2 with qkv
# bias, Qwen3 with q/k norm) over a flat batch of tokens and a paged KV cache.
# Weights come straight from the HF safetensors checkpoint.

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from safetensors import safe_open

from workers.scheduler.fused import choose_ops, rms_norm
from workers.scheduler.linear import ONEDNN_ROWS, PLAIN, Dense, Kernels, make_linear


@dataclass(frozen=True)
class ModelSpec:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_eps: float
    rope_theta: float
    max_position: int
    tie_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    eos_token_ids: frozenset[int]

    def projections(self) -> dict[str, tuple[int, int]]:
        """Each layer's projections as (out, in), stacked as the engine runs them:
        q, k and v as one; gate and up as one."""
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return {"qkv": (q + 2 * kv, self.hidden_size), "o": (self.hidden_size, q),
                "gate_up": (2 * self.intermediate_size, self.hidden_size),
                "down": (self.hidden_size, self.intermediate_size)}


def _ids(value: int | list[int] | None) -> set[int]:
    return set() if value is None else {value} if isinstance(value, int) else set(value)


def read_spec(model_dir: Path) -> ModelSpec:
    """The one adapter over HF config.json (and generation_config.json) fields."""
    cfg = json.loads((model_dir / "config.json").read_text())
    generation = model_dir / "generation_config.json"
    gen = json.loads(generation.read_text()) if generation.exists() else {}
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise ValueError(f"rope type {rope_type!r} is not supported")
    model_type = cfg.get("model_type", "llama")
    heads = cfg["num_attention_heads"]
    return ModelSpec(
        hidden_size=cfg["hidden_size"], intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"], num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        vocab_size=cfg["vocab_size"], rms_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=rope.get("rope_theta", cfg.get("rope_theta", 10000.0)),
        max_position=cfg.get("max_position_embeddings", 4096),
        tie_embeddings=cfg.get("tie_word_embeddings", False),
        qkv_bias=cfg.get("attention_bias", False) or model_type == "qwen2",
        qk_norm=model_type == "qwen3",
        eos_token_ids=frozenset(_ids(cfg.get("eos_token_id")) | _ids(gen.get("eos_token_id"))),
    )


@dataclass
class Layer:
    input_norm: torch.Tensor
    qkv: Dense  # q, k and v projections stacked: one matmul
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o: Dense
    post_norm: torch.Tensor
    gate_up: Dense  # gate and up stacked: one matmul
    down: Dense


class LlamaModel:
    """`quantization` and `kernels` are make_linear's for every projection."""

    def __init__(self, spec: ModelSpec, weights: dict[str, torch.Tensor], device: torch.device,
                 dtype: torch.dtype, quantization: str = "none", kernels: Kernels = PLAIN):
        self.spec, self.dtype, self.quantization = spec, dtype, quantization
        self.kernels = kernels

        def get(name: str) -> torch.Tensor:
            return weights[name].to(device=device, dtype=dtype)

        self.embed = get("model.embed_tokens.weight")
        head = "model.embed_tokens.weight" if spec.tie_embeddings else "lm_head.weight"
        self.lm_head = make_linear(weights[head].to(device), None, dtype, quantization,
                                   kernels)
        self.norm = get("model.norm.weight")
        self.layers = [self._layer(get, weights, f"model.layers.{i}.", device)
                       for i in range(spec.num_layers)]
        self.cos, self.sin = rope_tables(spec, device, dtype)
        self.ops = choose_ops(device, dtype)
        self.driver = None  # layers.Driver: every layer in one C call, where it applies

    def _layer(self, get, weights: dict, p: str, device: torch.device) -> Layer:
        def linear(names: list[str], bias: bool = False, fine: bool = False) -> Dense:
            """`fine`: activations rounded to 14 bits where the kernels' choice is int8."""
            weight = torch.cat([weights[n + ".weight"] for n in names]).to(device)
            b = torch.cat([weights[n + ".bias"] for n in names]).to(device) if bias else None
            kernels = replace(self.kernels, fine=True) if fine else self.kernels
            return make_linear(weight, b, self.dtype, self.quantization, kernels)

        attn = p + "self_attn."
        return Layer(
            input_norm=get(p + "input_layernorm.weight"),
            # q and k errors go through attention's softmax: int8 activations move
            # qkv by ~5e-3 of its size, more than rounding its output to bf16 does;
            # 14-bit ones by 6e-5, as exact as bf16 sums are. Steps of up to
            # linear.FINE_ROWS rows (they stream weights) take 14 bits at little cost;
            # bigger ones int8 (bench/quant_accuracy.py: mean KL 0.0091 against 0.0082,
            # top-1 agreement 99% against 93%: within rounding chaos)
            qkv=linear([attn + f"{n}_proj" for n in "qkv"], bias=self.spec.qkv_bias, fine=True),
            q_norm=get(attn + "q_norm.weight") if self.spec.qk_norm else None,
            k_norm=get(attn + "k_norm.weight") if self.spec.qk_norm else None,
            o=linear([attn + "o_proj"]), post_norm=get(p + "post_attention_layernorm.weight"),
            gate_up=linear([p + "mlp.gate_proj", p + "mlp.up_proj"]),
            down=linear([p + "mlp.down_proj"]),
        )

    @classmethod
    def load(cls, model_dir: Path, spec: ModelSpec, device: torch.device, dtype: torch.dtype,
             quantization: str = "none", kernels: Kernels = PLAIN) -> LlamaModel:
        weights: dict[str, torch.Tensor] = {}
        for file in sorted(model_dir.glob("*.safetensors")):
            with safe_open(str(file), framework="pt") as f:
                weights.update({name: f.get_tensor(name) for name in f.keys()})
        return cls(spec, weights, device, dtype, quantization, kernels)

    def warm(self, max_rows: int) -> None:
        """oneDNN's kernels for every row count a step of up to `max_rows` rows
        pads to (linear.ONEDNN_ROWS), built now, not in the first steps that
        need them (the layers share their shapes: the first one's serve)."""
        spec, layer = self.spec, self.layers[0]
        widths = ((layer.qkv, spec.hidden_size), (layer.o, spec.num_heads * spec.head_dim),
                  (layer.gate_up, spec.hidden_size), (layer.down, spec.intermediate_size))
        with torch.inference_mode():
            for rows in range(ONEDNN_ROWS, max_rows + ONEDNN_ROWS, ONEDNN_ROWS):
                for projection, width in widths:
                    if projection.onednn_weight is not None and rows > projection.small_batch:
                        projection(torch.zeros(rows, width, dtype=self.dtype))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, logit_rows: torch.Tensor,
                attend) -> torch.Tensor:
        """Hidden states of all tokens, logits (fp32) only of `logit_rows`.
        `attend(layer_index, q, k, v)` writes k, v to the cache and attends."""
        return self.lm_head.logits(self.head_input(input_ids, positions, logit_rows, attend))

    def head_input(self, input_ids: torch.Tensor, positions: torch.Tensor,
                   logit_rows: torch.Tensor, attend) -> torch.Tensor:
        """`forward` up to the lm_head: the final norm of `logit_rows` (ascending)."""
        if self.driver is not None and self.driver.takes(input_ids.shape[0], attend):
            x = self.driver(input_ids, positions)  # the same kernels as _layers, in one call
        else:
            x = self._layers(self.embed[input_ids], positions, attend)
        # every row samples in a step of decodes: no gather (a parallel region of its own)
        return x if logit_rows.shape[0] == x.shape[0] else x[logit_rows]

    def _layers(self, h: torch.Tensor, positions: torch.Tensor, attend) -> torch.Tensor:
        """Every decoder layer on the residual stream h (updated in place), then
        the final norm, made for every row by the kernel of the layers' norms
        (which rounds where transformers' RMSNorm does)."""
        spec, ops, eps = self.spec, self.ops, self.spec.rms_eps
        num_q, num_kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        x = ops.add_rms_norm(h, None, self.layers[0].input_norm, eps)
        for index, layer in enumerate(self.layers):
            qk, v = layer.qkv(x).split([num_q + num_kv, num_kv], dim=-1)
            qk = qk.view(-1, spec.num_heads + spec.num_kv_heads, spec.head_dim)
            if layer.q_norm is not None:
                qk = torch.cat([
                    rms_norm(qk[:, :spec.num_heads], layer.q_norm, eps),
                    rms_norm(qk[:, spec.num_heads:], layer.k_norm, eps)], dim=1)
            ops.rope_(qk, positions, self.cos, self.sin)  # q and k side by side
            q, k = qk.split([spec.num_heads, spec.num_kv_heads], dim=1)
            out = attend(index, q, k, v.view(-1, spec.num_kv_heads, spec.head_dim))
            x = ops.add_rms_norm(h, layer.o(out), layer.post_norm, eps)
            down = layer.down(ops.silu_mul(layer.gate_up(x)))
            last = index + 1 == len(self.layers)
            x = ops.add_rms_norm(h, down, self.norm if last else self.layers[index + 1].input_norm,
                                 eps)
        return x


def rope_tables(spec: ModelSpec, device: torch.device,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    half = spec.head_dim // 2
    inv_freq = 1.0 / (spec.rope_theta ** (torch.arange(0, half, dtype=torch.float32) / half))
    angles = torch.outer(torch.arange(spec.max_position, dtype=torch.float32), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().to(device, dtype), angles.sin().to(device, dtype)
