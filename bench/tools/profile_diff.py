"""Two torch.profiler tables side by side, kernel by kernel: what one run spends on the GPU that the other does not.

    python bench/tools/profile_diff.py BASE.txt OTHER.txt [--top 25] [--min-ms 0.5]

BASE and OTHER are the tables `moe-fp4 compare --profile` writes (profile_fp8.txt, profile_fp4.txt: torch's
``key_averages().table()``, sorted by CUDA time, the same number of steps in both). Prints, per row name, the
self CUDA time in each and OTHER - BASE, largest differences first, then the totals of the GPU kernels alone
(rows with no CPU time: what ran on the device, without the host-side operator rows that double-count them, and
without the "nccl:..." rows that repeat their NCCL kernel's).
Names that torch cut with "..." are compared as cut; two kernels whose names differ only after the cut add up.
"""

from __future__ import annotations

import argparse
import re
import sys

_UNITS = {"s": 1e3, "ms": 1.0, "us": 1e-3, "ns": 1e-6}


def _ms(text: str) -> float:
    m = re.fullmatch(r"([0-9.]+)(s|ms|us|ns)", text.strip())
    if not m:
        raise ValueError(f"not a time: {text!r}")
    return float(m.group(1)) * _UNITS[m.group(2)]


def parse(path: str) -> dict[str, tuple[float, float, int]]:
    """A profiler table -> {name: (self CUDA ms, self CPU ms, calls)}, rows of one name summed."""
    rows: dict[str, tuple[float, float, int]] = {}
    header = None
    with open(path) as f:
        for line in f:
            if not line.strip() or set(line.strip()) <= {"-", " "}:
                continue
            cells = re.split(r"\s{2,}", line.strip())
            if header is None:
                if "Name" in cells and "Self CUDA" in cells:
                    header = cells
                continue
            if line.startswith("Self CPU time total") or line.startswith("Self CUDA time total"):
                continue
            if len(cells) != len(header):
                continue
            row = dict(zip(header, cells))
            try:
                cuda, cpu, calls = _ms(row["Self CUDA"]), _ms(row["Self CPU"]), int(row["# of Calls"])
            except (KeyError, ValueError):
                continue
            old = rows.get(row["Name"], (0.0, 0.0, 0))
            rows[row["Name"]] = (old[0] + cuda, old[1] + cpu, old[2] + calls)
    if header is None:
        raise ValueError(f"{path}: no profiler table (a header with Name and Self CUDA)")
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("base")
    p.add_argument("other")
    p.add_argument("--top", type=int, default=25, help="rows to print (largest |difference| first)")
    p.add_argument("--min-ms", type=float, default=0.0, help="leave out rows whose difference is smaller")
    a = p.parse_args(argv)
    base, other = parse(a.base), parse(a.other)
    names = sorted(set(base) | set(other),
                   key=lambda n: -abs(other.get(n, (0, 0, 0))[0] - base.get(n, (0, 0, 0))[0]))
    print(f"{'self CUDA ms':>12} {'base':>9} {'other':>9} {'calls':>11}  name")
    shown = 0
    for n in names:
        b, o = base.get(n, (0.0, 0.0, 0)), other.get(n, (0.0, 0.0, 0))
        if abs(o[0] - b[0]) < a.min_ms or shown >= a.top:
            continue
        shown += 1
        print(f"{o[0] - b[0]:>+12.3f} {b[0]:>9.3f} {o[0]:>9.3f} {b[2]:>5}/{o[2]:<5}  {n[:100]}")

    def kernels(rows):
        # "nccl:<collective>" rows repeat their NCCL kernel's time: counted once, as the kernel
        return sum(cuda for name, (cuda, cpu, _) in rows.items() if cpu == 0 and not name.startswith("nccl:"))

    kb, ko = kernels(base), kernels(other)
    print(f"GPU rows without CPU time (kernels, copies, collectives): base {kb:.3f} ms, other {ko:.3f} ms, "
          f"difference {ko - kb:+.3f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
