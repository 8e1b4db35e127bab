# s39 GPU call: the session's new code on CUDA (warm-up tests with generate's line; block drafters
# and every drafter over the new families on CUDA's defaults; the paged block context kernels)
source .carry/s/setup.sh > $OUT/setup6.log 2>&1
S=$OUT/summary.log
echo "== $(date) $(nvidia-smi --query-gpu=name --format=csv,noheader) $(git log --oneline | head -1)" | tee -a $S
timeout 120 python -m pytest -q -p no:cacheprovider tests/parity/test_warm_up_gpu.py > $OUT/A_warm_up_gpu.log 2>&1
echo "A warm-up rc=$?" | tee -a $S; tail -3 $OUT/A_warm_up_gpu.log | tee -a $S
timeout 150 python -m pytest -q -n 6 -p no:cacheprovider tests/e2e/test_families_drafters.py > $OUT/B_families_drafters_cuda.log 2>&1
echo "B families drafters (CUDA) rc=$?" | tee -a $S; tail -3 $OUT/B_families_drafters_cuda.log | tee -a $S
timeout 60 python -m pytest -q -p no:cacheprovider tests/parity/test_paged_block_context_gpu.py > $OUT/C_paged_block_gpu.log 2>&1
echo "C paged block GPU rc=$?" | tee -a $S; tail -3 $OUT/C_paged_block_gpu.log | tee -a $S
