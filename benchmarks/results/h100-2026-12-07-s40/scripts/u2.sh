# s40 call 2: GGUF part 2 of 3; the soft-capped paged block context on CUDA; warm-up tests (tiny)
source .carry/s/setup.sh > $OUT/setup2.log 2>&1; tail -2 $OUT/setup2.log
S=$OUT/summary.log
timeout 80 python -m pytest -q -p no:cacheprovider tests/parity/test_paged_block_context_gpu.py > $OUT/C_paged_block_gpu.log 2>&1
echo "C paged block GPU rc=$?" | tee -a $S; tail -5 $OUT/C_paged_block_gpu.log | tee -a $S
timeout 100 python -m pytest -q -p no:cacheprovider tests/parity/test_warm_up_gpu.py -k "tiny and not builtin" > $OUT/A_warm_up_tiny.log 2>&1
echo "A warm-up tiny rc=$?" | tee -a $S; tail -3 $OUT/A_warm_up_tiny.log | tee -a $S
