"""bench/tools/profile_diff.py: two torch.profiler tables side by side (CPU; the tables of a stored GPU run)."""

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench" / "tools"))

import profile_diff  # noqa: E402

RUN = ROOT / "bench/results/2026-11-28_2xh200_12d0ea3-841c661_link/profile_order_36c0ca7/profile_fp8_fp4"

TABLE = """\
-------------  ------------  ------------  ------------  ------------  ------------  ------------
         Name    Self CPU %      Self CPU     Self CUDA   Self CUDA %    CUDA total    # of Calls
-------------  ------------  ------------  ------------  ------------  ------------  ------------
      kernelA         0.00%       0.000us       1.500ms        10.00%       1.500ms             3
     aten::mm         1.00%      10.000us     250.000us         5.00%     250.000us             2
      kernelA         0.00%       0.000us     500.000us        10.00%     500.000us             1
-------------  ------------  ------------  ------------  ------------  ------------  ------------
Self CPU time total: 1.000ms
Self CUDA time total: 2.250ms
"""


def test_parse_sums_a_name_and_reads_units(tmp_path):
    p = tmp_path / "t.txt"
    p.write_text(TABLE)
    rows = profile_diff.parse(str(p))
    assert rows == {"kernelA": (2.0, 0.0, 4), "aten::mm": (0.25, 0.01, 2)}


def test_parse_refuses_a_file_without_a_table(tmp_path):
    p = tmp_path / "t.txt"
    p.write_text("no table here\n")
    with pytest.raises(ValueError, match="no profiler table"):
        profile_diff.parse(str(p))


def test_stored_run_kernel_by_kernel(capsys):
    fp8, fp4 = profile_diff.parse(str(RUN / "profile_fp8.txt")), profile_diff.parse(str(RUN / "profile_fp4.txt"))
    # The fp4 mode's MXFP4 copy for backward and its MXFP4-reading SwiGLU backward, absent in fp8's table.
    assert fp8["_swiglu_quantize_kernel"] == pytest.approx((2.898, 0.0, 30))
    assert fp4["_swiglu_quantize_kernel"] == pytest.approx((6.138, 0.0, 30))
    assert "_swiglu_backward_mxfp4_kernel" in fp4 and "_swiglu_backward_mxfp4_kernel" not in fp8
    assert profile_diff.main([str(RUN / "profile_fp8.txt"), str(RUN / "profile_fp4.txt"), "--top", "40"]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.endswith("_swiglu_quantize_kernel"))
    assert line.split()[:3] == ["+3.240", "2.898", "6.138"], line
    assert "GPU rows without CPU time" in out
