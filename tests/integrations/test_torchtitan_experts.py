"""moe_fp4.integrations.torchtitan: torchtitan 0.3's GroupedExperts converted to moe_fp4's engine.

- The converter swaps every GroupedExperts of a tiny torchtitan Qwen3-MoE config, aligns its token
  dispatcher to 128 rows, and leaves the state dict as it was (keys, shapes; loads both ways); a
  training config naming it goes through torchtitan's own config manager.
- The converted experts against torchtitan's own module on the same rows: output and gradients (input,
  w1, w2, w3) within measured SQNR bands per precision; a whole converted model's loss and gradients.
- Refusals name their reason, before any change: dims not multiples of 128, gpt-oss's experts (biases,
  clamped SwiGLU), a converted model converted again, bad choices, weights that are neither bf16 nor
  fp32, groups that are not multiples of 128.
- The FP8 pairs: w13's (w1 and w3 quantized apart, concatenated) bit for bit the concatenation's, and
  the engine's results with the pairs equal to its results without them; built once per weight version:
  not again in backward or the next micro-batch, again after an in-place write or an optimizer step
  (AdamW for-loop and fused).

The GEMMs are the engine's CPU emulation; the conversions run as pure-torch references (the kernels are
checked bit for bit against them in tests/formats and tests/model).
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from optional_stacks import import_or_skip

# test_integrations_gpu.py imports the same modules first, with stand-ins for what an older torch lacks.
import_or_skip("torchtitan.models.qwen3", "torchtitan.models.common.moe", "torchtitan.models.common.token_dispatcher")
# torchtitan's MoE router runs under autocast(float32), which CPU autocast declines with this warning.
pytestmark = pytest.mark.filterwarnings("ignore:In CPU autocast, but the target dtype is not supported:UserWarning")

# These imports follow import_or_skip on purpose (E402): the module is skipped before importing torchtitan
# where it (or one of the modules named above) is missing.
from helpers import in_band, sqnr_db  # noqa: E402
from torchtitan.models.common.moe import GroupedExperts, RoutedExperts  # noqa: E402
from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher  # noqa: E402

from moe_fp4.gemm.engines import FP8_WEIGHTS, quantize_fp8_weight_pair  # noqa: E402
from moe_fp4.integrations.torchtitan import (  # noqa: E402
    FP8_PAIRS,
    GroupedExpertsConverter,
    MoEFP4GroupedExperts,
    MoEFP4RoutedExperts,
    PaddedTokenDispatcher,
)

E, D, F = 4, 128, 128
TOKENS = (100, 200, 0, 128)            # real rows per expert; each group padded to 128 (expert 2 empty)
COUNTS = tuple(-(-t // 128) * 128 for t in TOKENS)
KEYS = ("out", "dx", "w1", "w2", "w3")

# SQNR (dB) of the converted experts against torchtitan's own GroupedExperts (bf16 grouped GEMMs) on the
# rows above, fp32 and bf16 weights, seeds 0-3 (CPU, 2026-11-28). Lowest measured:
#   bf16       out 48.83, dx 47.73, w1 48.76, w2 48.78, w3 48.76 (torchtitan rounds silu(gate) to bf16
#              before the product, the engine rounds the SwiGLU output once: 88 dB apart without that)
#   fp8        out 23.45, dx 23.44, w1 23.28, w2 23.41, w3 23.43
#   fp4        out 23.45, dx 16.78, w1 14.77, w2 15.69, w3 14.65 (fp8's forward; MXFP4-saved gradients)
#   fp4-nvfp4  out 23.45, dx 18.15, w1 16.04, w2 18.78, w3 16.08
# Floors 1 dB under the lowest; ceilings about 1 dB over the highest (fp8 out 23.70, dx 23.56, w1 23.47,
# w2 23.65, w3 23.61; fp4 dx 16.91, w1 14.89, w2 15.87, w3 14.77; fp4-nvfp4 dx 18.29, w1 16.37, w2 19.13,
# w3 16.28): a lossy precision that silently ran bf16 (49 dB) or saved FP8 instead of FP4 fails them.
SQNR_FLOOR_DB = {
    "bf16": {"out": 47.8, "dx": 46.7, "w1": 47.7, "w2": 47.7, "w3": 47.7},
    "fp8": {"out": 22.4, "dx": 22.4, "w1": 22.2, "w2": 22.4, "w3": 22.4},
    "fp4": {"out": 22.4, "dx": 15.7, "w1": 13.7, "w2": 14.6, "w3": 13.6},
    "fp4-nvfp4": {"out": 22.4, "dx": 17.1, "w1": 15.0, "w2": 17.7, "w3": 15.0},
}
SQNR_CEILING_DB = {
    "bf16": dict.fromkeys(KEYS, math.inf),
    "fp8": {"out": 24.7, "dx": 24.6, "w1": 24.5, "w2": 24.7, "w3": 24.7},
    "fp4": {"out": 24.7, "dx": 18.0, "w1": 15.9, "w2": 16.9, "w3": 15.8},
    "fp4-nvfp4": {"out": 24.7, "dx": 19.3, "w1": 17.4, "w2": 20.2, "w3": 17.3},
}
# A whole tiny Qwen3-MoE (1 layer, 8 experts, top 2, 128 tokens), converted against unconverted, one
# forward and backward: the loss's relative difference and the lowest expert-weight gradient SQNR,
# measured over seeds 0-3: bf16 4.2e-6 at most, gradients 48.39 dB at least; fp8 7.5e-5 at most, 23.41
# dB at least (23.70 at most). Bounds: the loss 3x the largest difference, the gradients 1 dB under the
# lowest, fp8's under a ceiling 1 dB over its highest. One layer: with two, a bf16 rounding difference in
# layer 0 flips a near-tie of layer 1's router and that expert's gradient drops to 16-22 dB (measured).
# Those are torchtitan's dispatcher path (route_tokens=False). moe_fp4's routing (route_tokens=True, the
# default), same seeds (CPU, 2026-11-28): bf16 loss 3.7e-6 at most, gradients 45.88-47.25 dB (the router
# score applied inside the SwiGLU and the k outputs summed in float32, where torchtitan scales each output in
# bf16 and scatter-adds in bf16: another rounding, both bf16-accurate); fp8 8.9e-5 at most, 23.44-23.80 dB.
MODEL_LOSS_RTOL = {("bf16", False): 1.3e-5, ("fp8", False): 2.3e-4, ("bf16", True): 1.1e-5, ("fp8", True): 2.7e-4}
MODEL_GRAD_FLOOR_DB = {("bf16", False): 47.3, ("fp8", False): 22.4, ("bf16", True): 44.8, ("fp8", True): 22.4}
MODEL_GRAD_CEILING_DB = {("bf16", False): math.inf, ("fp8", False): 24.7, ("bf16", True): math.inf,
                         ("fp8", True): 24.8}


def _weights(seed: int = 0, dtype=torch.float32) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: (torch.randn(s, generator=g) * 0.05).to(dtype)
            for n, s in (("w1_EFD", (E, F, D)), ("w2_EDF", (E, D, F)), ("w3_EFD", (E, F, D)))}


def _rows(seed: int = 0):
    """-> (x bf16 [R, D] grouped by expert, zero padding rows; counts int64 [E]; dy float32 [R, D])."""
    g = torch.Generator().manual_seed(seed + 100)
    x, start = torch.zeros(sum(COUNTS), D), 0
    for t, c in zip(TOKENS, COUNTS):
        x[start:start + t] = torch.randn(t, D, generator=g)
        start += c
    return x.bfloat16(), torch.tensor(COUNTS), torch.randn(sum(COUNTS), D, generator=g)


def _experts(precision=None, storage="mxfp4", weights=None, dtype=torch.float32):
    """torchtitan's GroupedExperts (precision None) or the converted module, holding ``weights``."""
    cfg = GroupedExperts.Config(dim=D, hidden_dim=F, num_experts=E)
    if precision is not None:
        cfg = MoEFP4GroupedExperts.Config(dim=D, hidden_dim=F, num_experts=E, precision=precision, storage=storage)
    m = cfg.build().to(dtype)
    m.load_state_dict(weights if weights is not None else _weights(dtype=dtype))
    return m


def _step(m, x, counts, dy) -> dict[str, torch.Tensor]:
    xi = x.clone().requires_grad_()
    y = m(xi, counts)
    (y.float() * dy).sum().backward()
    return {"out": y.detach(), "dx": xi.grad, "w1": m.w1_EFD.grad, "w2": m.w2_EDF.grad, "w3": m.w3_EFD.grad}


def _tiny_qwen3(n_layers: int = 2, dim: int = D, ffn: int = F, experts: int = 8):
    """A tiny Qwen3-MoE in torchtitan's own config classes (its registered MoE debug model has 64 experts
    of ffn 768): SDPA attention, which runs eagerly on CPU."""
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.qwen3 import Qwen3Model, _build_qwen3_moe_layers, _qwen3_norm

    init = {"weight": lambda t: torch.nn.init.normal_(t, std=0.02)}
    layers = _build_qwen3_moe_layers(
        n_layers=n_layers, dim=dim, n_heads=4, n_kv_heads=2, head_dim=32, moe_hidden_dim=ffn, num_experts=experts,
        top_k=2, attn_backend="flex", moe_comm_backend="standard",
        rope=CosSinRoPE.Config(dim=32, max_seq_len=64, theta=1e6))
    for layer in layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return Qwen3Model.Config(
        vocab_size=256, dim=dim, norm=_qwen3_norm(dim), layers=layers,
        tok_embeddings=Embedding.Config(num_embeddings=256, embedding_dim=dim, param_init=init),
        lm_head=Linear.Config(in_features=dim, out_features=256, param_init=init))


def _convert(cfg, **kw):
    return GroupedExpertsConverter.Config(**kw).build().convert(cfg)


def _routed(cfg) -> list:
    return [parent for _, _, parent, _ in cfg.traverse(GroupedExperts.Config)]


# ---------------------------------------------------------------------------------------------------
# (a), (d): the swap, the state dict, the alignment, the training config

def test_converter_swaps_every_grouped_experts_and_keeps_the_state_dict():
    torch.manual_seed(0)
    ref = _tiny_qwen3().build()
    ref.init_weights()
    cfg = _convert(_tiny_qwen3(), precision="fp4", storage="nvfp4")
    routed = _routed(cfg)
    assert len(routed) == 2
    for parent in routed:
        assert type(parent) is MoEFP4RoutedExperts.Config and parent.route_tokens
        assert type(parent.inner_experts) is MoEFP4GroupedExperts.Config
        assert (parent.inner_experts.precision, parent.inner_experts.storage) == ("fp4", "nvfp4")
        assert parent.inner_experts.param_init is not None   # torchtitan's init plan carried over
        assert type(parent.token_dispatcher) is PaddedTokenDispatcher.Config
        assert parent.token_dispatcher.pad_multiple == 128
    model = cfg.build()
    experts = [m for m in model.modules() if isinstance(m, GroupedExperts)]
    assert len(experts) == 2 and all(type(m) is MoEFP4GroupedExperts for m in experts)
    assert all(m.token_dispatcher.pad_multiple == 128 for m in model.modules() if isinstance(m, RoutedExperts))
    assert sum(type(m) is MoEFP4RoutedExperts for m in model.modules()) == 2
    theirs, ours = ref.state_dict(), model.state_dict()
    assert {k: tuple(v.shape) for k, v in theirs.items()} == {k: tuple(v.shape) for k, v in ours.items()}
    assert any(k.endswith("inner_experts.w1_EFD") for k in ours)
    model.load_state_dict(theirs)                        # torchtitan's checkpoint into the converted model
    back = _tiny_qwen3().build()
    back.load_state_dict(model.state_dict())             # and back
    assert all(torch.equal(theirs[k], v) for k, v in back.state_dict().items())


def test_training_config_names_the_converter():
    """torchtitan's trainer CLI: ``--module moe_fp4.integrations.torchtitan --config ...`` (its config
    manager, tyro included) gives torchtitan's deepseek_v3 debug model with every expert converted."""
    from torchtitan.config.manager import ConfigManager

    config = ConfigManager().parse_args(["--module", "moe_fp4.integrations.torchtitan",
                                         "--config", "deepseek_v3_debugmodel_fp4_experts"])
    found = list(config.model_spec.model.traverse(GroupedExperts.Config))
    assert found and all(type(c) is MoEFP4GroupedExperts.Config and c.precision == "fp4" for _, c, _, _ in found)
    assert all(p.token_dispatcher.pad_multiple == 128 for _, _, p, _ in found)


def test_dispatcher_hands_the_experts_128_row_groups(references):
    """In a converted model the experts see groups of multiples of 128 rows (empty experts: none) whose
    padding rows are zero; an unaligned group reaching the experts is refused before any work."""
    torch.manual_seed(0)
    # torchtitan's dispatcher path (what EP takes): without EP the default routes the tokens itself
    model = _convert(_tiny_qwen3(n_layers=1), precision="bf16", route_tokens=False).build()
    model.init_weights()
    seen = []
    experts = next(m for m in model.modules() if isinstance(m, MoEFP4GroupedExperts))
    experts.register_forward_pre_hook(lambda _m, args: seen.append((args[0].detach(), args[1].tolist())))
    tokens = torch.randint(0, 256, (2, 64))
    model(tokens, positions=torch.arange(64).repeat(2, 1))
    (x, counts), = seen
    assert sum(counts) == x.shape[0] and all(c % 128 == 0 for c in counts) and sum(counts) > 0
    with pytest.raises(ValueError, match="multiple of 128"):
        experts(x[:100], torch.tensor([100] + [0] * 7))


def test_padded_permute_orders_rank_major_segments_expert_major():
    """PaddedTokenDispatcher._permute as under EP = 2 (rank-major (rank, expert) segments in, expert-major
    groups padded to 128 out) against the rows listed by hand, padding rows zero; _unpermute gives the input
    back; forward and backward of the round trip equal torchtitan's indexing (a copy with a sentinel row)."""
    d = PaddedTokenDispatcher.Config(num_experts=6, top_k=1, pad_multiple=128).build()
    d.ep_mesh = type("Mesh", (), {"size": lambda self: 2})()
    sizes = torch.tensor([3, 0, 130, 5, 0, 1])          # rank 0: experts 0-2; rank 1: experts 0-2
    x = torch.arange(1, int(sizes.sum()) + 1, dtype=torch.float32)[:, None].repeat(1, 4)
    shape, out, dst, padded = d._permute(x, sizes)
    starts = (sizes.cumsum(0) - sizes).tolist()
    want = []   # each padded row's input row, x.shape[0] for a padding row
    for j in range(3):
        rows = [i for r in range(2) for i in range(starts[3 * r + j], starts[3 * r + j] + int(sizes[3 * r + j]))]
        want += rows + [x.shape[0]] * (-len(rows) % 128)
    idx = torch.tensor(want)
    x_ext = torch.cat([x, x.new_zeros(1, 4)])
    assert padded.tolist() == [128, 0, 256] and tuple(shape) == tuple(x.shape) and padded.device.type == "cpu"
    assert torch.equal(out, x_ext[idx]) and torch.equal(idx[dst], torch.arange(x.shape[0]))
    assert torch.equal(d._unpermute(out, shape, dst), x)
    # forward and backward through permute -> (rows * w) -> unpermute, against torchtitan's indexing
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
    g = torch.randn(x.shape, generator=torch.Generator().manual_seed(3))
    xg, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
    got = d._unpermute(d._permute(xg, sizes)[1] * w, shape, dst)
    back = (torch.cat([xr, xr.new_zeros(1, 4)])[idx] * w)
    ref = back.new_empty(x_ext.shape)
    ref[idx] = back   # torchtitan's TorchAOTokenDispatcher._unpermute
    ref = ref[:-1]
    got.backward(g)
    ref.backward(g)
    assert torch.equal(got, ref) and torch.equal(xg.grad, xr.grad) and xg.grad.abs().sum() > 0


# ---------------------------------------------------------------------------------------------------
# (b): numerics against torchtitan's own module and model

@pytest.fixture(scope="module")
def reference_step():
    x, counts, dy = _rows()
    return _step(_experts(), x, counts, dy)


@pytest.mark.parametrize("mode", ["bf16", "fp8", "fp4", "fp4-nvfp4"])
def test_experts_against_torchtitans_own(reference_step, mode, references):
    precision, _, storage = mode.partition("-")
    x, counts, dy = _rows()
    got = _step(_experts(precision, storage or "mxfp4"), x, counts, dy)
    # helpers.sqnr_db fails on NaN / Inf; the band is written so that a NaN would fail it too.
    measured = {k: sqnr_db(reference_step[k].float(), got[k].float(), f"{mode} {k}") for k in KEYS}
    outside = {k: (round(v, 2), SQNR_FLOOR_DB[mode][k], SQNR_CEILING_DB[mode][k]) for k, v in measured.items()
               if not SQNR_FLOOR_DB[mode][k] <= v <= SQNR_CEILING_DB[mode][k]}
    assert not outside, f"{mode}: SQNR (measured, floor, ceiling) outside its band: {outside}"
    assert got["out"][sum(COUNTS[:2]) - 56:sum(COUNTS[:2])].abs().sum() == 0   # padding rows give zero


def test_bf16_weights_and_rows_past_the_last_group(references):
    """bf16 parameters (FSDP's mixed precision) in fp8, and rows past the last group (torchao's
    dispatcher pads to a fixed length): those come back zero, the rest as without them."""
    w = _weights(dtype=torch.bfloat16)
    x, counts, dy = _rows()
    ref = _step(_experts(weights=w, dtype=torch.bfloat16), x, counts, dy)
    tail = torch.cat([x, x.new_zeros(128, D)])
    got = _step(_experts("fp8", weights=w, dtype=torch.bfloat16), tail, counts, torch.cat([dy, dy[:128]]))
    assert got["out"][-128:].abs().sum() == 0 and got["w1"].dtype == torch.bfloat16
    got = dict(got, out=got["out"][:-128], dx=got["dx"][:-128])
    for k in KEYS:
        in_band(sqnr_db(ref[k].float(), got[k].float(), k), SQNR_FLOOR_DB["fp8"][k], SQNR_CEILING_DB["fp8"][k], k)


@pytest.mark.parametrize("route_tokens", [True, False], ids=["moe_fp4_routing", "torchtitan_dispatcher"])
@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_converted_model_against_unconverted(precision, route_tokens, references):
    """Both paths of the converted RoutedExperts against torchtitan's unconverted model; moe_fp4's routing
    (no EP) never calls the experts module's forward, torchtitan's dispatcher path always does."""
    torch.manual_seed(0)
    ref = _tiny_qwen3(n_layers=1).build()
    ref.init_weights()
    model = _convert(_tiny_qwen3(n_layers=1), precision=precision, route_tokens=route_tokens).build()
    model.load_state_dict(ref.state_dict())
    calls = []
    for m in model.modules():
        if isinstance(m, MoEFP4GroupedExperts):
            m.register_forward_pre_hook(lambda *_: calls.append(1))
    tokens = torch.randint(0, 256, (2, 65), generator=torch.Generator().manual_seed(1))
    losses, grads = [], []
    for m in (ref, model):
        logits = m(tokens[:, :-1], positions=torch.arange(64).repeat(2, 1))
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        loss.backward()
        losses.append(loss.item())
        grads.append({n: p.grad for n, p in m.named_parameters() if "inner_experts" in n})
    assert (calls == []) == route_tokens
    key = (precision, route_tokens)
    assert abs(losses[1] - losses[0]) <= MODEL_LOSS_RTOL[key] * abs(losses[0]), losses
    db = [sqnr_db(grads[0][n], grads[1][n], n) for n in grads[0]]
    assert len(db) == 3
    in_band(min(db), MODEL_GRAD_FLOOR_DB[key], MODEL_GRAD_CEILING_DB[key], f"{key} expert grads")


# ---------------------------------------------------------------------------------------------------
# (c): refusals

def test_refusals_name_their_reason_before_any_change():
    from torchtitan.models.gpt_oss.moe import GptOssGroupedExperts

    for dim, ffn, reason in ((192, 128, "model \\(hidden\\) dim = 192"), (128, 96, "expert ffn \\(hidden_dim\\) = 96")):
        cfg = _tiny_qwen3(dim=dim, ffn=ffn)
        before = [(type(p.inner_experts), type(p.token_dispatcher)) for p in _routed(cfg)]
        with pytest.raises(ValueError, match=f"{reason} is not a multiple of 128"):
            _convert(cfg)
        assert [(type(p.inner_experts), type(p.token_dispatcher)) for p in _routed(cfg)] == before
    cfg = _tiny_qwen3(n_layers=2)   # layer 1 gpt-oss: layer 0, checked first, must stay unconverted too
    gpt = GptOssGroupedExperts.Config(dim=D, hidden_dim=F, num_experts=8)
    _routed(cfg)[1].inner_experts = gpt
    with pytest.raises(ValueError, match="biases and a clamped SwiGLU"):
        _convert(cfg)
    assert type(_routed(cfg)[0].inner_experts) is GroupedExperts.Config
    assert type(_routed(cfg)[0].token_dispatcher) is AllToAllTokenDispatcher.Config
    with pytest.raises(ValueError, match="converted already"):
        _convert(_convert(_tiny_qwen3()))
    with pytest.raises(ValueError, match="precision must be one of"):
        GroupedExpertsConverter.Config(precision="fp16")
    with pytest.raises(ValueError, match="storage must be one of"):
        GroupedExpertsConverter.Config(storage="fp4")
    bad = GroupedExpertsConverter.Config()
    bad.precision = "int8"                       # a slots dataclass can be written after its checks
    with pytest.raises(ValueError, match="precision must be one of"):
        bad.build()


def test_weights_neither_bf16_nor_fp32_are_refused():
    m = _experts("fp8").to(torch.float16)
    x, counts, _ = _rows()
    builds = FP8_PAIRS.builds
    with pytest.raises(ValueError, match="must all be bfloat16 or all float32"):
        m(x, counts)
    assert FP8_PAIRS.builds == builds and m not in FP8_PAIRS._entries   # refused before any work
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        with pytest.raises(ValueError, match="must all be bfloat16 or all float32"):
            MoEFP4GroupedExperts.Config(dim=D, hidden_dim=F, num_experts=E).build()
    finally:
        torch.set_default_dtype(before)


# ---------------------------------------------------------------------------------------------------
# (e): the FP8 pairs

def test_w13_pair_is_the_concatenations_pair(references):
    """w1 and w3 quantized apart and concatenated along N: the codes and 128x128 block scales of W, and of W^T
    made from them as backward makes it, bit for bit those of quantize_fp8_weight_pair(cat(w1, w3)); blocks of
    many binades (distinct scales)."""
    g = torch.Generator().manual_seed(3)
    scale = lambda: torch.randint(-8, 8, (E, F // 128, 1, D // 128, 1), generator=g).float().exp2()  # noqa: E731
    m = _experts("fp8")
    with torch.no_grad():
        for w in (m.w1_EFD, m.w3_EFD):
            w.copy_((torch.randn(E, F // 128, 128, D // 128, 128, generator=g) * scale()).reshape(E, F, D))
    q, none = FP8_PAIRS.get(m, "w13", (m.w1_EFD, m.w3_EFD), (m.w1_EFD, m.w3_EFD))
    assert none is None                                      # W^T: made in backward from W
    want = quantize_fp8_weight_pair(torch.cat([m.w1_EFD, m.w3_EFD], dim=1))
    for a, b in zip((q, q.t()), want):
        assert a.data.shape == b.data.shape and a.scale.shape == b.scale.shape
        assert torch.equal(a.data.view(torch.uint8), b.data.view(torch.uint8)) and torch.equal(a.scale, b.scale)
    assert len(set(want[0].scale.flatten().tolist())) > 4    # 8 blocks (E x 2 x 1), scales apart


@pytest.mark.parametrize("precision", ["fp8", "fp4"])
def test_pairs_give_the_engines_own_results(precision, references):
    """With the pairs and stand-ins, bit for bit what the engine computes from the real weights (the
    concatenation, FP8_WEIGHTS off): the pairs are the weights' and the gradients reach w1, w3 and w2."""
    x, counts, dy = _rows()
    got = _step(_experts(precision), x, counts, dy)
    FP8_WEIGHTS.enabled = False
    try:
        want = _step(_experts(precision), x, counts, dy)
    finally:
        FP8_WEIGHTS.enabled = True
    assert all(torch.equal(got[k], want[k]) for k in KEYS), [k for k in KEYS if not torch.equal(got[k], want[k])]


@pytest.mark.parametrize("fused", [False, True], ids=["adamw", "adamw_fused"])
def test_pairs_built_once_per_weight_version(fused, references):
    """Two micro-batches, an optimizer step, another: the pairs (w13, w2) are built in the first forward
    only, reused by its backward and the second micro-batch, built again after the step (torch's AdamW;
    the fused one leaves the weights' _version alone) and after an in-place write; a rebuilt pair is
    the new weights' (the step's forward equals a fresh module's on the stepped weights)."""
    x, counts, dy = _rows()
    m = _experts("fp8")
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2, foreach=False, fused=fused)
    FP8_PAIRS.clear()
    b0 = FP8_PAIRS.builds
    m(x, counts)
    assert FP8_PAIRS.builds == b0 + 2
    y = m(x, counts)                                    # the first micro-batch (the one above: no grad use)
    assert FP8_PAIRS.builds == b0 + 2
    (y.float() * dy).sum().backward()
    (m(x, counts).float() * dy).sum().backward()        # the second micro-batch
    assert FP8_PAIRS.builds == b0 + 2 and FP8_PAIRS.nbytes > 0
    opt.step()
    assert FP8_PAIRS.nbytes == 0                        # every step drops the pairs
    y = m(x, counts)
    assert FP8_PAIRS.builds == b0 + 4
    fresh = _experts("fp8", weights={k: v.detach().clone() for k, v in m.state_dict().items()})
    assert torch.equal(y, fresh(x, counts))
    assert FP8_PAIRS.builds == b0 + 6                   # fresh's two
    with torch.no_grad():
        m.w3_EFD.mul_(2)                                # a write outside any optimizer: a new _version
    m(x, counts)
    assert FP8_PAIRS.builds == b0 + 7                   # w13's pair again, w2's as it was


def test_dtensor_weights(references):
    """Expert weights as DTensors (what EP / FSDP make; one gloo rank here): the forward takes their local
    tensors, the results are bit for bit the plain module's, the gradients reach the DTensors, and an
    in-place write rebuilds the pair (a DTensor bumps its own _version, not its local tensor's)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        x, counts, dy = _rows()
        want = _step(_experts("fp8"), x, counts, dy)
        m = _experts("fp8")
        for name, p in list(m.named_parameters()):
            setattr(m, name, torch.nn.Parameter(distribute_tensor(p.detach(), mesh, [Shard(0)])))
        builds = FP8_PAIRS.builds
        got = _step(m, x, counts, dy)
        assert all(isinstance(got[k], DTensor) for k in ("w1", "w2", "w3"))
        got = {k: v.to_local() if isinstance(v, DTensor) else v for k, v in got.items()}
        assert all(torch.equal(got[k], want[k]) for k in KEYS), [k for k in KEYS if not torch.equal(got[k], want[k])]
        m(x, counts)
        assert FP8_PAIRS.builds == builds + 2
        with torch.no_grad():
            m.w1_EFD.mul_(2)
        m(x, counts)
        assert FP8_PAIRS.builds == builds + 3
    finally:
        dist.destroy_process_group()


def test_module_configs_are_dataclasses_of_torchtitans():
    """The converted Config is torchtitan's GroupedExperts.Config plus precision and storage (so sharding
    and init plans that set fields on it keep working)."""
    ours = {f.name for f in dataclasses.fields(MoEFP4GroupedExperts.Config)}
    theirs = {f.name for f in dataclasses.fields(GroupedExperts.Config)}
    assert ours - theirs == {"precision", "storage"} and theirs <= ours


# ---------------------------------------------------------------------------------------------------
# The example

# examples/torchtitan_fp8_experts.py --precision fp4 --steps 3 (torchtitan's deepseek_v3 debug model, 5 MoE
# layers): the converted model's loss against the unconverted one's, measured 7.1e-7, 7.9e-5, 3.9e-5
# (relative; fp8: 7.1e-7, 3.3e-5, 3.9e-5); bound 3x the largest. The loss falls 8.07 -> 5.93 in both.
EXAMPLE_LOSS_RTOL = 2.4e-4


def test_example_trains_the_converted_model():
    import os
    import re
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, TRITON_INTERPRET="0", OMP_NUM_THREADS="1")
    run = subprocess.run([sys.executable, os.path.join(root, "examples", "torchtitan_fp8_experts.py"),
                          "--precision", "fp4", "--steps", "3"], env=env, capture_output=True, text=True,
                         timeout=180, cwd=root)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "experts ['MoEFP4GroupedExperts'], precision fp4" in run.stdout, run.stdout
    steps = re.findall(r"step \d: loss unconverted ([\d.]+), converted \(fp4\) ([\d.]+)", run.stdout)
    assert len(steps) == 3, run.stdout   # digits only: a nan loss does not match
    for ref, got in ((float(a), float(b)) for a, b in steps):
        assert abs(got - ref) <= EXAMPLE_LOSS_RTOL * ref, run.stdout
    assert float(steps[-1][1]) < float(steps[0][1]) - 1, run.stdout
    assert "FP8 weight copies built: 30 over 3 steps" in run.stdout, run.stdout   # 5 MoE layers x 2 x 3


def test_blocks_compile_fullgraph_with_the_converter(references):
    """torchtitan compiles each transformer block with fullgraph=True (a graph break is an error there): the
    converted blocks compile without EP (moe_fp4's routing, device counts, the experts' op pair, the FP8
    pairs made in the graph), and the loss and the expert gradients are the eager model's, bit for bit."""
    torch.manual_seed(0)
    model = _convert(_tiny_qwen3(n_layers=1), precision="fp8").build()
    model.init_weights()
    tokens = torch.randint(0, 256, (2, 65), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(64).repeat(2, 1)

    def step():
        model.zero_grad(set_to_none=True)
        logits = model(tokens[:, :-1], positions=positions)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        loss.backward()
        return [loss.detach()] + [p.grad for n, p in model.named_parameters() if "inner_experts" in n]

    eager = step()
    torch._dynamo.reset()
    layers = model.layers.values() if hasattr(model.layers, "values") else model.layers
    for layer in layers:
        layer.compile(fullgraph=True, backend="aot_eager")
    compiled = step()
    assert len(compiled) == 4
    for a, b in zip(eager, compiled):
        assert not a.isnan().any() and torch.equal(a, b)
