# s33 call 3: order-sensitive cuBLAS check on the GPU: batch-invariance tests, the float values
# replay, the tiny models' replay suite, plain TPOT before (62ea854) / after with the check's verdicts
source .carry/s/setup.sh > /dev/null
date
timeout 150 python -m pytest -q tests/parity/test_batch_invariance_gpu.py > $OUT/A_batch_inv.log 2>&1; tail -4 $OUT/A_batch_inv.log
timeout 120 python -m pytest -q tests/parity/test_replay_gpu.py -k "float and values" > $OUT/B_values.log 2>&1; tail -3 $OUT/B_values.log
date
for R in 1 2; do
 for V in old new; do
  if [ $V = old ]; then PP=/tmp/site:$PWD/.carry/v/old/src:$PWD/.carry/v/old/benchmarks:$PWD/benchmarks; else PP=$PYTHONPATH; fi
  PYTHONPATH=$PP timeout 200 python benchmarks/probes/probe_plain_tpot.py --batches 1,64 --new-tokens 256 --out $OUT/C_tpot_${V}_$R.json 2>&1 | grep -E "batch|Error" | tail -3
 done
done
python -c "import json; print(json.load(open('$OUT/C_tpot_new_1.json')).get('cublas_rows'))"
date
timeout 240 python -m pytest -q -n 4 tests/parity/test_replay_gpu.py -k "not builtin" > $OUT/D_replay_tiny.log 2>&1; tail -12 $OUT/D_replay_tiny.log
date
