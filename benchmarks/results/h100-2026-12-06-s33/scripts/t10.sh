# s33 call 1: the float model's CUDA values gap (linear probe, graphs and eager), replay suite on
# the tiny models, plain TPOT before (62ea854) / after
source .carry/s/setup.sh > /dev/null
python -c "import xdist" 2>/dev/null && echo xdist yes || echo xdist no
cd $PWD
export PYTHONPATH=$PYTHONPATH:$PWD/.carry/s
date
TAG=graph timeout 240 python -m pytest -q -p linear_probe tests/parity/test_replay_gpu.py -k "float and values" > $OUT/A_values_graph.log 2>&1; tail -5 $OUT/A_values_graph.log
EAGER=1 TAG=eager timeout 240 python -m pytest -q -p linear_probe tests/parity/test_replay_gpu.py -k "float and values" > $OUT/B_values_eager.log 2>&1; tail -5 $OUT/B_values_eager.log
date
python - <<'PY'
import json, os
for t in ("graph", "eager"):
    p = os.path.join(os.environ["OUT"], f"linear_probe{t}.json")
    if os.path.exists(p):
        d = json.load(open(p)); print(t, "mismatching calls", d["num_mismatches"])
        for m in d["mismatches"][:6]: print("  ", m)
PY
for R in 1 2 3 4; do
 for V in old new; do
  if [ $V = old ]; then PP=/tmp/site:$PWD/.carry/v/old/src:$PWD/.carry/v/old/benchmarks:$PWD/benchmarks; else PP=$PYTHONPATH; fi
  PYTHONPATH=$PP timeout 200 python benchmarks/probes/probe_plain_tpot.py --batches 64 --new-tokens 256 --out $OUT/C_tpot_${V}_$R.json 2>&1 | grep -E "batch|Error" | tail -3
 done
done
date
