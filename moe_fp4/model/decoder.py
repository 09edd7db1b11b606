"""A small DeepSeek-V3-style decoder for end-to-end comparisons (``moe-fp4 compare``).

token embedding -> L blocks -> RMSNorm -> LM head, each block ``x + attn(norm(x))`` then
``x + mlp(norm(x))``: causal self-attention with rotary embeddings through
``torch.nn.functional.scaled_dot_product_attention``; the MLP of the first ``dense_layers`` blocks is
a dense SwiGLU, the others are :class:`moe_fp4.model.moe.MoE` (top-k router, routed SwiGLU experts, a shared
expert). Parameters are float32 master copies; every layer computes in bf16 (weights cast on use).

Only the MoE layers change with the precision mode ("bf16" | "fp8" | "fp4", :attr:`DecoderLM.precision`):
attention, the dense MLP, norms, embeddings and the head stay bf16 in every mode, as in the method
this package implements (FP4 for the experts' stored activations and the dispatch, FP8 GEMMs in the
experts).

Recomputation: ``recompute`` ("none" | "swiglu" | "moe" | "dense" | "layer", :class:`moe_fp4.model.moe.Recompute`)
trades what a forward keeps for backward for compute, with gradients identical to "none" in the same precision.

Expert parallelism: with an :class:`~moe_fp4.exchange.ep.EPConfig` each rank holds E / world experts per MoE
layer and every other parameter is replicated. :meth:`DecoderLM.init_weights` gives every rank the
same replicated weights and expert e the same weights wherever it lives (one generator seed per
global expert), so a run at any EP width starts from the model a single GPU would build.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from moe_fp4.exchange.ep import EPConfig
from moe_fp4.model.experts import Precision
from moe_fp4.model.moe import MoE, MoEConfig, Recompute, ScoreFunction, checkpoint
from moe_fp4.saved.policy import StorageFormat

BYTE_VOCAB = 256


@dataclass(frozen=True)
class ModelConfig:
    """Decoder shape. hidden, ffn, dense_ffn and shared_ffn multiples of 128 (FP8 tiles);
    hidden = heads * head_dim with an even head_dim (rotary pairs)."""

    vocab: int
    hidden: int
    layers: int
    heads: int
    dense_ffn: int
    ffn: int
    num_experts: int
    top_k: int
    shared_ffn: int = 0
    dense_layers: int = 1
    seq: int = 1024
    score: ScoreFunction = ScoreFunction.SIGMOID
    rope_theta: float = 10000.0

    def __post_init__(self):
        object.__setattr__(self, "score", ScoreFunction(self.score))
        for name in ("vocab", "hidden", "layers", "heads", "dense_ffn", "seq"):
            if getattr(self, name) <= 0:
                raise ValueError(f"ModelConfig: {name} must be positive, got {getattr(self, name)}")
        if self.hidden % self.heads or (self.hidden // self.heads) % 2:
            raise ValueError(f"ModelConfig: hidden = {self.hidden} must be heads ({self.heads}) times an even head_dim")
        if self.dense_ffn % 128:
            raise ValueError(f"ModelConfig: dense_ffn = {self.dense_ffn} must be a multiple of 128")
        if not 0 <= self.dense_layers <= self.layers:
            raise ValueError(f"ModelConfig: dense_layers = {self.dense_layers} must be in [0, layers = {self.layers}]")
        _ = self.moe  # MoEConfig validates hidden, ffn, shared_ffn, experts and top_k

    @property
    def moe(self) -> MoEConfig:
        return MoEConfig(hidden=self.hidden, ffn=self.ffn, num_experts=self.num_experts, top_k=self.top_k,
                         shared_ffn=self.shared_ffn, score=self.score)

    @property
    def moe_layers(self) -> int:
        return self.layers - self.dense_layers

    def with_(self, **changes) -> "ModelConfig":
        return replace(self, **{k: v for k, v in changes.items() if v is not None})


# Byte-level vocabulary (the stdlib text of moe_fp4.compare.data). "dsv3-layers" has DeepSeek-V3's hidden,
# heads, dense FFN, expert width, top-8 routing and shared expert, with 32 experts instead of 256.
PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(vocab=BYTE_VOCAB, hidden=128, layers=2, heads=2, dense_ffn=256, ffn=128,
                        num_experts=8, top_k=2, shared_ffn=128, seq=64),
    "small": ModelConfig(vocab=BYTE_VOCAB, hidden=1024, layers=6, heads=8, dense_ffn=2816, ffn=512,
                         num_experts=16, top_k=4, shared_ffn=512, seq=1024),
    "dsv3-layers": ModelConfig(vocab=BYTE_VOCAB, hidden=7168, layers=3, heads=56, dense_ffn=18432, ffn=2048,
                               num_experts=32, top_k=8, shared_ffn=2048, seq=1024),
}


def _rope_tables(seq: int, head_dim: int, theta: float, device) -> tuple[torch.Tensor, torch.Tensor]:
    inv = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim)
    ang = torch.outer(torch.arange(seq, dtype=torch.float32, device=device), inv)
    return ang.cos(), ang.sin()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, heads, S, D] -> the same with each (even, odd) pair rotated by its position's angle."""
    x1, x2 = x.float().unflatten(-1, (-1, 2)).unbind(-1)
    return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1).flatten(-2).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, c: ModelConfig, device=None):
        super().__init__()
        kw = {"dtype": torch.float32, "device": device}
        self.heads = c.heads
        self.wqkv = nn.Parameter(torch.empty(3 * c.hidden, c.hidden, **kw))
        self.wo = nn.Parameter(torch.empty(c.hidden, c.hidden, **kw))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = F.linear(x, self.wqkv.to(x.dtype)).view(b, s, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        o = F.scaled_dot_product_attention(_rotate(q, cos[:s], sin[:s]), _rotate(k, cos[:s], sin[:s]), v,
                                           is_causal=True)
        return F.linear(o.transpose(1, 2).reshape(b, s, h), self.wo.to(x.dtype))


class DenseMLP(nn.Module):
    def __init__(self, hidden: int, ffn: int, device=None):
        super().__init__()
        kw = {"dtype": torch.float32, "device": device}
        self.w13 = nn.Parameter(torch.empty(2 * ffn, hidden, **kw))
        self.w2 = nn.Parameter(torch.empty(hidden, ffn, **kw))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(x, self.w13.to(x.dtype)).chunk(2, -1)
        return F.linear(F.silu(gate) * up, self.w2.to(x.dtype))


class Block(nn.Module):
    def __init__(self, c: ModelConfig, dense: bool, precision, device=None, ep: EPConfig | None = None):
        super().__init__()
        self.attn_norm = nn.RMSNorm(c.hidden, eps=1e-6, device=device, dtype=torch.float32)
        self.attn = Attention(c, device)
        self.mlp_norm = nn.RMSNorm(c.hidden, eps=1e-6, device=device, dtype=torch.float32)
        self.mlp = DenseMLP(c.hidden, c.dense_ffn, device) if dense else \
            MoE(c.moe, precision=precision, dtype=torch.float32, device=device, ep=ep)

        self.recompute = Recompute.NONE   # set by DecoderLM.recompute; the block applies DENSE and LAYER

    def _attention(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return x + self.attn(F.rms_norm(x, x.shape[-1:], self.attn_norm.weight.to(x.dtype), 1e-6), cos, sin)

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(F.rms_norm(x, x.shape[-1:], self.mlp_norm.weight.to(x.dtype), 1e-6))

    def _forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return self._mlp(self._attention(x, cos, sin))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled() or self.recompute not in (Recompute.DENSE, Recompute.LAYER):
            return self._forward(x, cos, sin)
        if self.recompute is Recompute.LAYER:
            return checkpoint(self._forward, x, cos, sin)
        # DENSE: the attention sub-block (and a dense layer's MLP) keeps its input only; the MoE block runs
        # outside any checkpoint and keeps its own activations (MXFP4 in fp4).
        x = checkpoint(self._attention, x, cos, sin)
        return checkpoint(self._mlp, x) if isinstance(self.mlp, DenseMLP) else self._mlp(x)


class DecoderLM(nn.Module):
    """forward(ids int64 [B, S], targets int64 [B, S] or None) -> mean next-token cross-entropy (float32
    scalar) when targets are given, else logits float32 [B, S, vocab]. S <= config.seq."""

    def __init__(self, config: ModelConfig, precision: str | Precision = "fp8", device=None,
                 ep: EPConfig | None = None, seed: int = 0, recompute: str | Recompute = "none",
                 storage: str = "mxfp4"):
        super().__init__()
        # Each choice refused (naming its parameter) before any weight is allocated.
        precision, recompute, storage = Precision(precision), Recompute(recompute), StorageFormat(storage)
        self.config = c = config
        self.embed = nn.Parameter(torch.empty(c.vocab, c.hidden, dtype=torch.float32, device=device))
        self.blocks = nn.ModuleList(Block(c, i < c.dense_layers, precision, device, ep) for i in range(c.layers))
        self.norm = nn.RMSNorm(c.hidden, eps=1e-6, device=device, dtype=torch.float32)
        self.head = nn.Parameter(torch.empty(c.vocab, c.hidden, dtype=torch.float32, device=device))
        cos, sin = _rope_tables(c.seq, c.hidden // c.heads, c.rope_theta, device)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        self.recompute = recompute
        for m in self.moe_layers():
            m.storage = storage   # fp4's activation format (moe_fp4.model.moe.MoE.storage)
        self.init_weights(seed)

    def moe_layers(self) -> list[MoE]:
        return [b.mlp for b in self.blocks if isinstance(b.mlp, MoE)]

    @property
    def precision(self) -> Precision:
        return self.moe_layers()[0].precision if self.moe_layers() else Precision.BF16

    @precision.setter
    def precision(self, value) -> None:
        for m in self.moe_layers():
            m.precision = value

    @property
    def recompute(self) -> Recompute:
        """The recomputation policy (:class:`moe_fp4.model.moe.Recompute`): "swiglu" and "moe" apply to the MoE
        layers, "dense" recomputes every block's attention and the dense blocks' MLP from their inputs (the MoE
        layers keep everything), "layer" recomputes every decoder block (dense ones too) from its input."""
        return self._recompute

    @recompute.setter
    def recompute(self, value) -> None:
        self._recompute = value = Recompute(value)
        for b in self.blocks:
            b.recompute = value
        for m in self.moe_layers():
            m.recompute = Recompute.NONE if value in (Recompute.DENSE, Recompute.LAYER) else value

    def expert_parameters(self) -> list[nn.Parameter]:
        """The routed experts' weights: sharded over the EP group (every other parameter is replicated)."""
        return [p for m in self.moe_layers() for p in (m.w13, m.w2)]

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Deterministic init from ``seed``: std hidden^-0.5 for matrices reading the residual stream,
        fan-in^-0.5 for the MLP outputs, 1 for norms; routed expert e (global index) from its own seed."""
        c = self.config
        dev = self.embed.device
        if dev.type == "meta":
            return
        gen = torch.Generator(dev).manual_seed(seed)
        std = c.hidden ** -0.5
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif isinstance(self._owner(name), MoE) and name.rsplit(".", 1)[-1] in ("w13", "w2"):
                continue
            else:
                fan_in = p.shape[-1]
                p.normal_(0.0, std if name.endswith(("wqkv", "w13", "weight", "embed", "head")) else fan_in ** -0.5,
                          generator=gen)
        for layer, m in enumerate(self.moe_layers()):
            sharded = m.ep is not None and not m.ep.simulate
            first = torch.distributed.get_rank(m.ep.process_group) * m.num_local_experts if sharded else 0
            for e in range(m.num_local_experts):
                g = torch.Generator(dev).manual_seed(seed * 1_000_003 + (layer + 1) * 65_537 + first + e)
                m.w13[e].normal_(0.0, std, generator=g)
                m.w2[e].normal_(0.0, c.ffn ** -0.5, generator=g)

    def _owner(self, name: str) -> nn.Module:
        return self.get_submodule(name.rsplit(".", 1)[0]) if "." in name else self

    def forward(self, ids: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        c = self.config
        if ids.dim() != 2 or ids.shape[1] > c.seq:
            raise ValueError(f"DecoderLM: expected ids [B, S <= {c.seq}], got {tuple(ids.shape)}")
        x = F.embedding(ids, self.embed).to(torch.bfloat16)
        for block in self.blocks:
            x = block(x, self.cos, self.sin)
        x = F.rms_norm(x, x.shape[-1:], self.norm.weight.to(x.dtype), 1e-6)
        logits = F.linear(x, self.head.to(x.dtype)).float()
        if targets is None:
            return logits
        return F.cross_entropy(logits.view(-1, c.vocab), targets.reshape(-1))


def parameter_count(model: DecoderLM) -> dict[str, int]:
    """{"total": parameters on this rank, "experts": routed expert parameters on this rank,
    "active_per_token": parameters one token's forward touches (k routed experts per MoE layer)}."""
    c = model.config
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for p in model.expert_parameters())
    per_expert = 3 * c.hidden * c.ffn
    local = (model.moe_layers()[0].num_local_experts if model.moe_layers() else 0)
    active = total - experts + c.moe_layers * c.top_k * per_expert if local else total
    return {"total": total, "experts": experts, "active_per_token": active}


__all__ = ["BYTE_VOCAB", "DecoderLM", "ModelConfig", "PRESETS", "parameter_count"]
