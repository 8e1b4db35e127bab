# s34 call 3: the int4 failure of the new split (traceback, blocking launches), the prompt-row
# tests, the wide kept-quantized model's replay cases and negative control, fp8 steps before/after
source .carry/s/setup.sh > /dev/null
date
CUDA_LAUNCH_BLOCKING=1 timeout 100 python benchmarks/probes/probe_quant_steps.py --formats int4 --out $OUT/A_int4_new.json > $OUT/A_int4_trace.log 2>&1; grep -B2 -A3 "Error\|error" $OUT/A_int4_trace.log | head -60
date
timeout 200 python -m pytest -q -n 4 tests/parity/test_quant_gpu.py -k "prompt_rows" tests/parity/test_replay_gpu.py -k "prompt_rows or quantized" > $OUT/B_tests.log 2>&1; tail -8 $OUT/B_tests.log | grep -v "^[0-9.]*s \(call\|setup\)"
date
for V in new base; do
  if [ $V = base ]; then PP=/tmp/site:$PWD/.carry/v/base/src:$PWD/benchmarks; else PP=$PYTHONPATH; fi
  PYTHONPATH=$PP timeout 100 python benchmarks/probes/probe_quant_steps.py --formats fp8 --out $OUT/C_fp8_$V.json 2>&1 | grep -E "fp8|Error" | tail -2
done
date
