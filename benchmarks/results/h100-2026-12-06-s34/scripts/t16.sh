# s34 call 1: s33's partition-merge kernels on a GPU for the first time (kernel parity suites,
# tiny-model replay), plain TPOT at max_model_len 1024 vs 4096, quantized products at prefill rows
source .carry/s/setup.sh > /dev/null
date
timeout 200 python -m pytest -q -n 4 tests/parity/test_batch_invariance_gpu.py tests/parity/test_long_attention_gpu.py tests/parity/test_window_softcap_gpu.py tests/parity/test_tree_attention_gpu.py tests/parity/test_paged_block_context_gpu.py > $OUT/A_kernels.log 2>&1; tail -15 $OUT/A_kernels.log | grep -v "^[0-9.]*s \(call\|setup\)"
date
timeout 150 python -m pytest -q -n 6 tests/parity/test_replay_gpu.py -k "not builtin" > $OUT/B_replay_tiny.log 2>&1; tail -6 $OUT/B_replay_tiny.log | grep -v "^[0-9.]*s \(call\|setup\)"
date
for R in 1 2; do for L in 1024 4096; do
  timeout 100 python benchmarks/probes/probe_plain_tpot.py --batches 1,64 --new-tokens 256 --max-model-len $L --out $OUT/C_tpot_${L}_$R.json 2>&1 | grep -E "batch|Error" | tail -3
done; done
date
timeout 120 python benchmarks/probes/probe_quant_kernels.py --rows 1,64,256,1024,2048 --out $OUT > $OUT/D_quant.log 2>&1; echo rc $?; tail -30 $OUT/D_quant.log
date
