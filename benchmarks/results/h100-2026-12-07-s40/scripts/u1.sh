# s40 call 1: GGUF part 1 of 3 and the wheels; s39's block drafters over the new families on CUDA
source .carry/s/setup.sh > $OUT/setup1.log 2>&1; tail -2 $OUT/setup1.log
S=$OUT/summary.log
echo "== $(date) $(nvidia-smi --query-gpu=name --format=csv,noheader) $(git log --oneline | head -1)" | tee -a $S
timeout 150 python -m pytest -q -n 6 -p no:cacheprovider tests/e2e/test_families_drafters.py > $OUT/B_families_drafters_cuda.log 2>&1
echo "B families drafters (CUDA) rc=$?" | tee -a $S; tail -5 $OUT/B_families_drafters_cuda.log | tee -a $S
