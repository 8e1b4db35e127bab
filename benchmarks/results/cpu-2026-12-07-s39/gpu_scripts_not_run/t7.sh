# s39 last GPU call: block drafters over the new families on CUDA; generate's warm-up line
source .carry/s/setup.sh > $OUT/setup7.log 2>&1
S=$OUT/summary.log
echo "== $(date) $(nvidia-smi --query-gpu=name --format=csv,noheader) $(git log --oneline | head -1)" | tee -a $S
timeout 100 python -m pytest -q -n 6 -p no:cacheprovider tests/e2e/test_families_drafters.py -k "block or copying" > $OUT/B_families_drafters_cuda.log 2>&1
echo "B block drafters over families (CUDA) rc=$?" | tee -a $S; tail -3 $OUT/B_families_drafters_cuda.log | tee -a $S
timeout 70 python -m pytest -q -p no:cacheprovider tests/parity/test_warm_up_gpu.py -k generate > $OUT/A_generate_warm_up.log 2>&1
echo "A generate warm-up rc=$?" | tee -a $S; tail -3 $OUT/A_generate_warm_up.log | tee -a $S
