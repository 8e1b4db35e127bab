# s34 call 4: the LM head's prompt rows split too; prompt-row tests, the wide model's replay cases
# and negative control (joining arrivals), int4 steps before/after
source .carry/s/setup.sh > /dev/null
date
timeout 150 python -m pytest -q -n 4 tests/parity/test_quant_gpu.py -k "prompt_rows or engine" tests/parity/test_replay_gpu.py -k "prompt_rows or quantized or engine" > $OUT/A_tests.log 2>&1; tail -6 $OUT/A_tests.log | grep -v "^[0-9.]*s \(call\|setup\)"
date
for V in new base; do
  if [ $V = base ]; then PP=/tmp/site:$PWD/.carry/v/base/src:$PWD/benchmarks; else PP=$PYTHONPATH; fi
  PYTHONPATH=$PP timeout 100 python benchmarks/probes/probe_quant_steps.py --formats int4 --out $OUT/B_int4_$V.json > $OUT/B_int4_$V.log 2>&1; grep -E "int4 |Error" $OUT/B_int4_$V.log | tail -3
done
date
