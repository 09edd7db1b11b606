"""AdamW that writes the FP8 expert weights while it updates them.

The FP8 expert GEMMs read every expert weight W as 128x128-block FP8 codes, and their dgrad reads W^T, its
codes transposed in backward (:data:`moe_fp4.gemm.engines.FP8_WEIGHTS` holds W per weight version). With torch's
AdamW, W is made in the next forward: one more pass over the weights per optimizer step, which BF16 training
does not pay.
:class:`AdamWFP8Weights` is torch.optim.AdamW, except that each weight the FP8 GEMMs read takes a fused
step (``kernels/adamw.py``): one pass updates W and its moments and writes the FP8 codes of the new W
into the cache, so the next forward finds them there.

    opt = moe_fp4.model.optim.AdamWFP8Weights(model.parameters(), lr=3e-4, weight_decay=0.1)

Which weights take the fused step is decided by the cache, at each step: a parameter whose FP8 copy
the GEMMs made since its last change (an expert weight of the fp8 or fp4 precisions), with a dense
contiguous gradient, its moments contiguous, on CUDA (or under TRITON_INTERPRET=1: elsewhere the
pure-torch twin runs). Everything else (embeddings, norms, the router, bf16 experts, the first step
before any forward) takes torch's AdamW step with the group's own ``foreach`` / ``fused`` choice.
``last_step_fp8_params`` counts the fused parameters of the last step.

Numerics: the fused update is AdamW in float32 (moe_fp4.kernels.adamw: torch's update order; torch's
fused kernel computes some products in double, so the two agree to an ulp or so, not bit for bit). The
FP8 codes are bit for bit quantize_fp8_weight of the updated weight (the kernel also writes W^T, which
the cache does not keep). The state is torch's
(``step``, ``exp_avg``, ``exp_avg_sq``), so state dicts move between the two optimizers.
"""

from __future__ import annotations

import torch

from moe_fp4.gemm.engines import FP8_WEIGHTS, FP8WeightCache, adamw_step_fp8_weight
from moe_fp4.kernels.adamw import AdamWScalars

_FUSED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _unhooked_adamw_step():
    """torch.optim.AdamW.step without the profiling / hook wrapper torch.optim puts on a class's step once
    an instance exists: this optimizer's own step carries that wrapper, so hooks run once per step."""
    f = torch.optim.AdamW.step
    return f.__wrapped__ if getattr(f, "hooked", False) else f


class AdamWFP8Weights(torch.optim.AdamW):
    """torch.optim.AdamW whose step also makes the FP8 copy W of each weight the FP8 expert GEMMs read, in the
    same pass as the update, and hands it to ``cache`` (default: moe_fp4.gemm.engines.FP8_WEIGHTS).

    Arguments are AdamW's; ``amsgrad`` is not offered (its update is not fused: use torch's AdamW), and
    a group with ``capturable`` or ``differentiable`` set takes torch's step for all its parameters.
    Under ``torch.amp.GradScaler`` the scaler unscales the gradients itself before ``step``
    (``_step_supports_amp_scaling`` is off, even with ``fused=True``).
    """

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, *, maximize: bool = False, foreach: bool | None = None,
                 fused: bool | None = None, capturable: bool = False, differentiable: bool = False,
                 cache: FP8WeightCache | None = None):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=False,
                         maximize=maximize, foreach=foreach, fused=fused, capturable=capturable,
                         differentiable=differentiable)
        if cache is not None and not isinstance(cache, FP8WeightCache):
            raise TypeError(f"AdamWFP8Weights: cache must be an FP8WeightCache, got {type(cache).__name__}")
        # Read by FP8WeightCache's optimizer-step hook: this optimizer keeps that cache itself.
        self.fp8_weight_cache = FP8_WEIGHTS if cache is None else cache
        # The fused FP8 step reads grad as it is: a GradScaler must unscale (and skip on inf) first.
        self._step_supports_amp_scaling = False
        self.last_step_fp8_params = 0

    def _fusable(self, p: torch.Tensor, group: dict) -> bool:
        g = p.grad
        if g is None or p not in self.fp8_weight_cache or group["amsgrad"] or group["capturable"] \
                or group["differentiable"]:
            return False
        if p.dim() not in (2, 3) or p.dtype not in _FUSED_DTYPES or g.is_sparse or g.shape != p.shape \
                or g.dtype not in _FUSED_DTYPES or g.device != p.device:
            return False
        if p.shape[-1] % 128 or p.shape[-2] % 128 or not (p.is_contiguous() and g.is_contiguous()):
            return False
        state = self.state.get(p)
        if state:
            if "exp_avg" not in state or "exp_avg_sq" not in state:
                return False
            if not (state["exp_avg"].is_contiguous() and state["exp_avg_sq"].is_contiguous()):
                return False
        return True

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        cache = self.fp8_weight_cache
        fp8, kept_params = [], []
        for group in self.param_groups:
            rest = []
            for p in group["params"]:
                if self._fusable(p, group):
                    fp8.append((p, group))
                else:
                    rest.append(p)
                    if p.grad is not None:     # torch's step below changes it, behind its version if fused
                        cache.discard(p)
                    self._step_to_torch_device(p, group)
            kept_params.append(group["params"])
            group["params"] = rest
        try:
            _unhooked_adamw_step()(self)
        finally:
            for group, params in zip(self.param_groups, kept_params):
                group["params"] = params
        for p, group in fp8:
            self._fp8_step(p, group)
        self.last_step_fp8_params = len(fp8)
        return loss

    def _step_to_torch_device(self, p: torch.Tensor, group: dict) -> None:
        """A state made by the fused step keeps ``step`` on the CPU (no sync to read it); torch's fused and
        capturable steps want it on p's device."""
        step = self.state.get(p, {}).get("step")
        if step is not None and (group["fused"] or group["capturable"]) and step.device != p.device:
            self.state[p]["step"] = step.to(p.device)

    def _fp8_step(self, p: torch.Tensor, group: dict) -> None:
        state = self.state[p]
        if not state:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        step = state["step"]
        if step.device.type != "cpu":   # from torch's fused step or a loaded state: read it once
            step = state["step"] = step.to("cpu", torch.float32)
        step += 1
        beta1, beta2 = group["betas"]
        scalars = AdamWScalars.at(int(step.item()), float(group["lr"]), float(beta1), float(beta2),
                                  float(group["eps"]), float(group["weight_decay"]), bool(group["maximize"]))
        cache = self.fp8_weight_cache
        cache.discard(p)   # the old copy goes before the new one is allocated (a pinned one is written in place)
        q = adamw_step_fp8_weight(p, p.grad, state["exp_avg"], state["exp_avg_sq"], scalars,
                                  out=cache.pinned_copy(p))
        cache.put(p, q)


__all__ = ["AdamWFP8Weights"]
