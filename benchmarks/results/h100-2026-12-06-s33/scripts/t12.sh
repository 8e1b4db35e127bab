# s33 call A: warm-up test, device rounds (tiny), TPOT outliers before/after
source .carry/s/setup.sh > /dev/null
date
timeout 120 python -m pytest -q tests/parity/test_warm_up_gpu.py -k plain_engine > $OUT/A_warm_up.log 2>&1; tail -3 $OUT/A_warm_up.log
timeout 200 python -m pytest -q -n 4 tests/parity/test_device_rounds_gpu.py > $OUT/B_rounds.log 2>&1; tail -6 $OUT/B_rounds.log
date
for R in 1 2 3; do
 for V in old new; do
  if [ $V = old ]; then PP=/tmp/site:$PWD/.carry/v/old/src:$PWD/.carry/v/old/benchmarks:$PWD/benchmarks; else PP=$PYTHONPATH; fi
  PYTHONPATH=$PP timeout 200 python benchmarks/probes/probe_plain_tpot.py --batches 64 --new-tokens 256 --out /tmp/C_tpot_${V}_$R.json 2>&1 | grep -E "batch|Error" | tail -3
 done
done
date
