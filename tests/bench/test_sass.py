"""bench/tools/sass.py compiles the conversion kernels for sm_90a on a CPU-only machine (Triton's bundled
cuobjdump) and counts their SASS per path. Also a structural check the count makes possible: the
four-codes-per-word FP8 -> MXFP4 path keeps its data in registers (no layout conversion of a data
tile), the property whose loss made the first SWAR decoders 4-6x slower (bench/RESULTS.md, issue 11)."""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_sass_counts_each_path_and_the_fp8_to_mxfp4_fast_path_converts_no_data_tile():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "tools" / "sass.py"), "fp8_to_mxfp4"], env=env,
                         capture_output=True, text=True, timeout=300, check=False)
    assert run.returncode == 0, run.stdout + run.stderr
    rows = {}
    for line in run.stdout.splitlines():
        parts = line.split()
        if parts and parts[0] == "fp8_to_mxfp4":
            rows[parts[1]] = dict(sass=int(parts[2]), per_thread=float(parts[3]), per_element=float(parts[4]),
                                  largest_convert=int(parts[6]))
    assert set(rows) == {"both", "fast", "general"}, run.stdout
    assert rows["fast"]["per_thread"] == 32 and abs(rows["fast"]["per_element"] - rows["fast"]["sass"] / 32) < 0.006
    # Each path alone is shorter than the kernel holding both.
    assert rows["fast"]["sass"] < rows["both"]["sass"] and rows["general"]["sass"] < rows["both"]["sass"]
    # The launcher's program is 4 rows x 32 blocks x 8 words: only per-block values (4 x 32) may
    # change layout (the data tile, 1024 words, must not).
    assert 0 < rows["fast"]["largest_convert"] <= 4 * 32, run.stdout


def test_the_column_kernel_at_the_launcher_defaults_does_not_spill(tmp_path):
    # One-warp programs hold a lot per thread: at nb = 2 the general path once needed 10087
    # local-memory loads and stores, which multiplied the kernel's DRAM traffic by 5 and made it 4.5x
    # slower even on data that never takes that path (bench/RESULTS.md, issue 11). The count must
    # also cover instructions past address 0xffff (this kernel has more than 4096): it is checked
    # against the dump's own instruction lines.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    dump = tmp_path / "colwise.sass"
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "tools" / "sass.py"), "mxfp4_to_fp8_colwise",
                          "--path", "both", "--dump", str(dump)], env=env, capture_output=True, text=True, timeout=300,
                         check=False)
    assert run.returncode == 0, run.stdout + run.stderr
    rows = [line.split() for line in run.stdout.splitlines() if line.startswith("mxfp4_to_fp8_colwise")]
    assert len(rows) == 1, run.stdout
    instructions = [ln for ln in dump.read_text().splitlines()
                    if re.match(r"\s+/\*[0-9a-f]+\*/\s+[A-Z@]", ln) and not re.search(r"\*/\s+NOP\b", ln)]
    assert int(rows[0][2]) == len(instructions)
    assert int(rows[0][-1]) == 0 and not any(re.search(r"\b(LDL|STL)\b", ln) for ln in instructions), run.stdout
