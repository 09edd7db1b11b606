#!/usr/bin/env bash
# The main job's GPU record: `moe-fp4 compare` at EP = NGPU (default 2) on one host, small preset.
#   A. NVLink, each mode at its largest batch within BUDGET GiB per GPU (--max-batch)
#   B. NVLink, every mode at fp8's largest batch from A (a batch that fills the baseline's memory)
#   C. the same with --slow-link (NCCL_P2P_DISABLE=1: host shared memory, ~24 GB/s, a network stand-in)
#   D. convergence: CONV_STEPS steps per mode on the stdlib text at batch CONV_BATCH
# Usage: bench/compare_ep.sh OUT_DIR [NGPU] [BUDGET_GIB] [STEPS]; PARTS="A B C D" selects parts;
# BATCH=N gives B and C their batch without A's JSON; COMPARE_ARGS adds options to every run (--no-plots).
# Run from outside the source tree (or with an installed moe_fp4 first on PYTHONPATH).
set -euo pipefail
out=${1:?usage: bench/compare_ep.sh OUT_DIR [NGPU] [BUDGET_GIB] [STEPS]}
ngpu=${2:-2}
budget=${3:-100}
steps=${4:-20}
parts=${PARTS:-A B C D}
mkdir -p "$out"
run() { python3 -m torch.distributed.run --nproc-per-node "$ngpu" -m moe_fp4 compare --preset small --no-progress \
          ${COMPARE_ARGS:-} "$@"; }
for p in $parts; do
  case $p in
    A) run --max-batch "$budget" --steps "$steps" --warmup 5 --out "$out/A_nvlink_maxbatch" 2>&1 | tee "$out/A.log" ;;
    B|C)
      b=${BATCH:-$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['max_batch']['fp8']['batch_max'])" \
          "$out/A_nvlink_maxbatch/compare.json")}
      if [ "$p" = B ]; then
        run --batch "$b" --steps "$steps" --warmup 5 --out "$out/B_nvlink_batch$b" 2>&1 | tee "$out/B.log"
      else
        run --batch "$b" --steps "$((steps / 2 + 2))" --warmup 3 --slow-link --out "$out/C_slowlink_batch$b" 2>&1 | tee "$out/C.log"
      fi ;;
    D) run --steps "${CONV_STEPS:-1000}" --batch "${CONV_BATCH:-16}" --warmup 20 --profile-steps 0 --data stdlib \
         --out "$out/D_convergence" 2>&1 | tee "$out/D.log" ;;
  esac
done
