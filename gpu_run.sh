#!/bin/bash
# throwaway: $1 commit, $2 what: ab | conv MODES...
export MOE_FP4_COMMIT=$1; what=$2; shift 2
L=$OUT/log.txt
rm -rf site old_site
pip install -q --no-deps --no-build-isolation --target site . > /dev/null 2>&1
NEW=$PWD/site
nvidia-smi --query-gpu=name --format=csv,noheader | tee -a $L
if [ $what = ab ]; then
  PYTHONPATH=$NEW timeout 300 python3 -P -m pytest -q -m gpu tests/test_grouped_gemm.py -x 2>&1 | tail -2 | tee -a $L
  PYTHONPATH=$NEW timeout 400 python3 -P bench/tools/gemm_ab.py --old old_tree/kernels/gluon_grouped_gemm.py --json $OUT/gemm_ab.json 2>&1 | grep -v "^wrote" | tee -a $L
fi
if [ $what = conv ]; then
  PYTHONPATH=$NEW timeout 590 python3 -P -m moe_fp4 compare --preset small --steps 1000 --global-batch 64 --batch 22 --modes "$@" --out $OUT/conv --no-plots 2>&1 | grep -v "step .*/1000" | tail -40 | tee -a $L
fi
