"""bench/tools/transpose_ceiling.py's kernel (the column kernels' tiles with no arithmetic) must be a
transpose, bit for bit, or the ceiling it measures means nothing: checked here on the pure-Triton
path (the script checks the PTX path on the GPU before it times it)."""

import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "bench"
_path, _modules = list(sys.path), set(sys.modules)
sys.path.insert(0, str(BENCH / "tools"))
try:
    import transpose_ceiling  # (puts bench/ on sys.path and imports bench/conversions.py and bench/harness.py)
finally:
    # bench/'s module names (conversions, harness, run, hook, gemm, ...) stay out of other tests' imports
    sys.path[:] = _path
    for _extra in set(sys.modules) - _modules:
        if (BENCH / f"{_extra}.py").exists():
            sys.modules.pop(_extra, None)


@pytest.mark.parametrize("m,k,g,warps", [(128, 32, 2, 1), (260, 64, 1, 2), (132, 128, 8, 1), (4, 16, 1, 1)])
def test_transpose_kernel_is_a_transpose(m, k, g, warps):
    x = torch.randint(0, 256, (m, k), dtype=torch.uint8, generator=torch.Generator().manual_seed(m * k + g))
    assert torch.equal(transpose_ceiling.transpose(x, g, warps, asm=False), x.t().contiguous())


def test_transpose_rejects_shapes_off_its_tiles():
    with pytest.raises(ValueError, match="M % 4 == 0"):
        transpose_ceiling.transpose(torch.zeros(6, 32, dtype=torch.uint8), 2)
    with pytest.raises(ValueError, match="K % 32 == 0"):
        transpose_ceiling.transpose(torch.zeros(8, 16, dtype=torch.uint8), 2)
