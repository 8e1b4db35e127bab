# s41 call 1: GGUF part 1 of 3 and the wheels; the one overlapped loop's GPU tests (device rounds, warm-up tiny)
source .carry/s/setup.sh > $OUT/setup1.log 2>&1; tail -2 $OUT/setup1.log
S=$OUT/summary.log
echo "== $(date) $(nvidia-smi --query-gpu=name --format=csv,noheader) $(git log --oneline | head -1)" | tee -a $S
timeout 260 python -m pytest -q -p no:cacheprovider tests/parity/test_device_rounds_gpu.py > $OUT/D_device_rounds_gpu.log 2>&1
echo "D device rounds GPU rc=$?" | tee -a $S; grep -E "^FAILED|passed|failed" $OUT/D_device_rounds_gpu.log | tail -8 | tee -a $S
timeout 120 python -m pytest -q -p no:cacheprovider tests/parity/test_warm_up_gpu.py -k "tiny and not builtin" > $OUT/W_warm_up_tiny.log 2>&1
echo "W warm-up tiny rc=$?" | tee -a $S; grep -E "^FAILED|passed|failed" $OUT/W_warm_up_tiny.log | tail -5 | tee -a $S
