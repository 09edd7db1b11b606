#!/usr/bin/env bash
# Issue 47's convergence matrix: `moe-fp4 compare --simulate-wire` runs (one process per GPU, each exchange's
# wire round trip applied where expert parallelism would send it; held-out loss without any wire, the same
# eval for every run), STEPS steps of the small preset at BATCH sequences, for SEEDS seeds each:
#   s<seed>_fp8: --modes fp8 (the fp8 baseline, its recipe fp8)
#   s<seed>_fp4_<recipe>: --modes fp4 --wire fp4:<recipe> per recipe in RECIPES (default: fp4-sr fp4-fp8sums
#   fp4-all fp4 paper); PRESET (default small) for a smoke test. Every run is one mode: the runs take equal time.
# Jobs go round-robin over NGPU x PER_GPU workers (PER_GPU processes share a GPU: default 1; at small batches one
# process leaves the GPU idle between kernels), each worker running its share in order; every run writes
# OUT/<job>/compare.json.
# Usage: bench/tools/convergence_matrix.sh OUT_DIR [NGPU] [STEPS] [BATCH]; SEEDS="0 1 2", RECIPES select,
# BASELINE=0 skips the fp8 runs.
# Then: python3 bench/tools/convergence_matrix.py OUT_DIR (the table, the verdicts and the plot).
set -euo pipefail
out=${1:?usage: bench/tools/convergence_matrix.sh OUT_DIR [NGPU] [STEPS] [BATCH]}
ngpu=${2:-1}
steps=${3:-1000}
batch=${4:-16}
seeds=${SEEDS:-0 1 2}
recipes=${RECIPES:-fp4-sr fp4-fp8sums fp4-all fp4 paper}
mkdir -p "$out"
jobs=()
# BASELINE=0 leaves the fp8 runs out (their seeds' runs from another job pair with these: convergence_matrix.py).
if [ "${BASELINE:-1}" != 0 ]; then for s in $seeds; do jobs+=("s${s}_fp8:$s:fp8:fp8:fp8"); done; fi
# A recipe may carry per-role overrides ("fp8,combine_grad=mxfp4-sr": fp8's wire with an MXFP4 combine gradient).
for r in $recipes; do for s in $seeds; do jobs+=("s${s}_fp4_${r}:$s:fp4:fp4:$r"); done; done
per_gpu=${PER_GPU:-1}
workers=$((ngpu * per_gpu))
work() {
  local w=$1 g=$(( $1 % ngpu )) i=0
  for j in "${jobs[@]}"; do
    if [ $((i % workers)) -eq "$w" ]; then
      IFS=: read -r name seed modes m r <<< "$j"
      CUDA_VISIBLE_DEVICES=$g python3 -m moe_fp4 compare --preset "${PRESET:-small}" --modes $modes --simulate-wire \
        --wire "$m:$r" --seed "$seed" --steps "$steps" --batch "$batch" \
        --warmup "$(( steps > 40 ? 20 : steps / 2 ))" --profile-steps 0 --no-progress --no-plots --out "$out/$name" > "$out/$name.log" 2>&1 || echo "FAILED: $name"
      echo "worker $w (gpu $g) done $name $(date +%T)"
    fi
    i=$((i + 1))
  done
}
for w in $(seq 0 $((workers - 1))); do work "$w" & done
wait
