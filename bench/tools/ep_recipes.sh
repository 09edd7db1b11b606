#!/usr/bin/env bash
# Issue 47's speed ladder: fp4 / fp8 tokens/s at the same batch, one `moe-fp4 compare --modes fp8 fp4` run per
# (fp8 recipe, fp4 recipe) pair and link, so each ratio comes from one run. EP = NGPU (default 2), small preset.
# Usage: bench/tools/ep_recipes.sh OUT_DIR [NGPU] [BATCH] [STEPS]; LINKS="nvlink slow" and
# PAIRS="fp8:fp4 ..." (fp8 recipe:fp4 recipe) select, fp4 recipe "default" leaving fp4's to its default on the
# link (fp4-sr on NVLink, fp4-all with --slow-link); PROFILE_PAIR (default fp8:fp4) also writes rank 0's
# kernel profile of both modes on NVLink (profile_fp8.txt, profile_fp4.txt).
# Run from outside the source tree (or with an installed moe_fp4 first on PYTHONPATH).
set -euo pipefail
out=${1:?usage: bench/tools/ep_recipes.sh OUT_DIR [NGPU] [BATCH] [STEPS]}
ngpu=${2:-2}
batch=${3:-48}
steps=${4:-20}
links=${LINKS:-nvlink slow}
pairs=${PAIRS:-fp8-dispatch:paper fp8:paper fp8:fp4 fp8:fp4-sr fp8:fp4-fp8sums fp8:fp4-all}
profile_pair=${PROFILE_PAIR:-fp8:fp4}
mkdir -p "$out"
for link in $links; do
  for pair in $pairs; do
    f8=${pair%%:*}; f4=${pair##*:}
    dir="$out/${link}_${f8}_${f4}"
    extra=()
    wire="fp8:$f8,fp4:$f4"
    [ "$f4" = default ] && wire="fp8:$f8"
    [ "$link" = slow ] && extra+=(--slow-link)
    [ "$link" = nvlink ] && [ "$pair" = "$profile_pair" ] && extra+=(--profile)
    python3 -m torch.distributed.run --nproc-per-node "$ngpu" -m moe_fp4 compare --preset small --modes fp8 fp4 \
      --batch "$batch" --steps "$steps" --warmup 5 --no-progress --no-plots --wire "$wire" \
      "${extra[@]}" --out "$dir" > "$dir.log" 2>&1 || echo "FAILED: $dir (see $dir.log)"
    python3 - "$dir/compare.json" "$link" "$f8" "$f4" <<'PY' || true
import json, sys
from moe_fp4.exchange.recipes import RECIPES
r = json.load(open(sys.argv[1]))
m = r["modes"]
b = {k: sum(v["wire_bytes_per_step"].values()) for k, v in m.items()}
f4 = sys.argv[4]
if f4 == "default":
    sent = r["meta"]["wire"]["per_mode"]["fp4"]
    f4 = f"default: {next(n for n, v in RECIPES.items() if v.as_dict() == sent)} on {r['meta']['wire']['link']}"
print(f"{sys.argv[2]:>6} fp8 {sys.argv[3]:<12} fp4 {f4:<12} tokens/s fp8 {m['fp8']['tokens_per_s_per_gpu']:>9,.0f} "
      f"fp4 {m['fp4']['tokens_per_s_per_gpu']:>9,.0f} ratio {m['fp4']['tokens_per_s_per_gpu'] / m['fp8']['tokens_per_s_per_gpu']:.3f} "
      f"a2a share fp8 {100 * m['fp8']['a2a_share']:.1f}% fp4 {100 * m['fp4']['a2a_share']:.1f}% "
      f"bytes/step fp4/fp8 {b['fp4'] / b['fp8']:.3f}", flush=True)
PY
  done
done
