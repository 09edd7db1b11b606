#!/usr/bin/env bash
# Issue 13's record: the all-to-all, the EP layer and `moe-fp4 compare` at EP = NGPU (4 or 8) on one
# host, with EP = 2 on the same host as the weak-scaling baseline. Each part fits one device command
# (under 10 minutes); run them one at a time, then R writes the tables.
#   T  GPU tests over NCCL at world NGPU (tests/exchange/test_comm_gpu.py: all-to-all values and gradients,
#      one host sync per EP layer, EP layer against the layer without EP)
#   L  bench/all_to_all.py on NVLink: hidden 7168, 8192..32768 rows per rank, the dsv3 and small EP layers
#   S  the same with NCCL_P2P_DISABLE=1 (NCCL over host shared memory: a network stand-in)
#   A  compare at EP = NGPU, each mode at its largest batch in BUDGET GiB per GPU
#   B  compare at EP = NGPU, every mode at fp8's largest batch from A (fills the baseline's memory)
#   W  compare at EP = 2 (GPUs 0 and 1) at B's batch per GPU: weak scaling, fp4 at EP NGPU over EP 2
#   C  B's run with --slow-link
#   R  bench/ep_report.py: markdown tables from the JSON above into OUT/tables.md
# Usage: PARTS="T L" bash bench/ep_scaling.sh OUT_DIR NGPU [BUDGET_GIB] [STEPS]
# Run from outside the source tree with the installed moe_fp4 first on PYTHONPATH (T runs the tests
# of this checkout against it). BATCH=N runs B, W and C at batch N without A's JSON (parts in separate
# device commands: OUT_DIR starts empty each time). Compare runs write no plots (2 files a part).
set -euo pipefail
out=${1:?usage: PARTS="T L S A B W C R" bash bench/ep_scaling.sh OUT_DIR NGPU [BUDGET_GIB] [STEPS]}
ngpu=${2:?NGPU: 4 or 8}
budget=${3:-100}
steps=${4:-20}
parts=${PARTS:-T L S A B W C R}
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(dirname "$here")
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0} TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
mkdir -p "$out"
a2a() { python3 -P -m torch.distributed.run --nproc-per-node "$ngpu" "$here/all_to_all.py" --hidden 7168 \
          --rows 8192 16384 32768 --layer dsv3 small --layer-tokens 8192 "$@"; }
export COMPARE_ARGS=${COMPARE_ARGS:---no-plots}
fp8_batch() { [ -n "${BATCH:-}" ] && { echo "$BATCH"; return; }
              python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['max_batch']['fp8']['batch_max'])" \
                "$out/ep${ngpu}/A_nvlink_maxbatch/compare.json"; }
for p in $parts; do
  case $p in
    T) python3 -P -m pytest -m gpu -q -p no:cacheprovider "$repo/tests/exchange/test_comm_gpu.py" 2>&1 | tee "$out/T_pytest_gpu.log" ;;
    L) a2a --json "$out/a2a_nvlink.json" 2>&1 | tee "$out/L.log" ;;
    S) NCCL_P2P_DISABLE=1 a2a --json "$out/a2a_shm.json" 2>&1 | tee "$out/S.log" ;;
    A|B|C) PARTS=$p bash "$here/compare_ep.sh" "$out/ep${ngpu}" "$ngpu" "$budget" "$steps" ;;
    W) b=$(fp8_batch)
       CUDA_VISIBLE_DEVICES=0,1 python3 -P -m torch.distributed.run --nproc-per-node 2 -m moe_fp4 compare --preset small \
         --no-progress $COMPARE_ARGS --batch "$b" --steps "$steps" --warmup 5 --out "$out/ep2/B_nvlink_batch$b" 2>&1 | tee "$out/W.log" ;;
    R) python3 -P "$here/ep_report.py" "$out" | tee "$out/tables.md" ;;
    *) echo "unknown part $p (T L S A B W C R)" >&2; exit 2 ;;
  esac
done
