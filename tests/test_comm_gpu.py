"""The all-to-all and the EP MoE layer over NCCL, one process per GPU (2 GPUs: ``nvidia-h200-x2``).

Marked ``gpu``; skipped without two CUDA devices. The same checks as the gloo tests, on the GPU
paths: Triton kernels for packing and unpacking, cuBLAS blockwise FP8 GEMMs in the layer.
"""

import pytest
import torch

import test_ep
from distributed import run_ranks

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")]

WORLD = 2


def _a2a_case(rank, world, device="cuda"):
    """Uneven splits (rank 1 sends rank 0 nothing); each format's rows equal the direct conversion of
    the rows sent to this rank, bit for bit; gradients arrive where their rows came from."""
    import moe_fp4
    from helpers import same_bits

    hidden = 1024
    sends = [[5, 0], [0, 7]] if world == 2 else None
    g = torch.Generator(device=device).manual_seed(0)
    xs = [torch.randn(sum(s), hidden, device=device, generator=g).to(torch.bfloat16) for s in sends]
    x = xs[rank].clone().requires_grad_()
    recv_splits = [sends[s][rank] for s in range(world)]
    expected = torch.cat([xs[s][sum(sends[s][:rank]):sum(sends[s][:rank + 1])] for s in range(world)])
    out = {}
    for fmt in ("bf16", "fp8", "mxfp4"):
        y = moe_fp4.all_to_all(x, recv_splits, sends[rank], forward=fmt, backward="bf16")
        if fmt == "bf16":
            ref = expected
        elif fmt == "fp8":
            ref = moe_fp4.quantize_fp8(expected).dequantize()
        else:
            ref = moe_fp4.quantize_mxfp4(expected).dequantize()
        out[f"{fmt}_values"] = same_bits(y.detach(), ref)
        x.grad = None
        (y.float() * (rank + 1)).sum().backward()
        # Each row's gradient is (receiving rank + 1): rows this rank sent to rank d get d + 1.
        want = torch.cat([torch.full((n, hidden), d + 1.0, device=device) for d, n in enumerate(sends[rank])])
        out[f"{fmt}_grad"] = torch.equal(x.grad.float(), want)
    r = moe_fp4.all_to_all(x, recv_splits, sends[rank], forward="mxfp4", output="fp8")
    ref = moe_fp4.mxfp4_to_fp8(moe_fp4.quantize_mxfp4(expected))
    out["mxfp4_to_fp8"] = same_bits(r.value.data, ref.data) and same_bits(r.value.scale, ref.scale)
    return out


def _layer_case(rank, world):
    return {p: test_ep._compare(rank, world, p, device="cuda") for p in ("bf16", "fp8", "fp4")}


def test_all_to_all_nccl():
    for rank, res in enumerate(run_ranks(_a2a_case, WORLD, backend="nccl")):
        assert all(res.values()), (rank, res)


def test_ep_layer_nccl_matches_single_gpu_layer():
    for rank, res in enumerate(run_ranks(_layer_case, WORLD, backend="nccl")):
        for precision, got in res.items():
            for name, floor in test_ep.EP_MATCH_FLOOR_DB[precision].items():
                assert got[name] >= floor, (rank, precision, name, got[name])
