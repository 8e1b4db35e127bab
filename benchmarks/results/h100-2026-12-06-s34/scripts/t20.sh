# s34 call 5: where the int4 engine fails with the prompt-row split (.carry/v/split: the
# experiment's source), every int4pack call logged and synchronized
source .carry/s/setup.sh > /dev/null
cat > /tmp/run_probe.py <<'PY'
import runpy, sys
sys.path.insert(0, ".carry/s")
import int4log  # noqa: F401
sys.argv = ["probe_quant_steps.py", "--formats", "int4", "--out", sys.argv[1]]
runpy.run_path("benchmarks/probes/probe_quant_steps.py", run_name="__main__")
PY
PYTHONPATH=/tmp/site:$PWD/.carry/v/split/src:$PWD/benchmarks timeout 120 python /tmp/run_probe.py $OUT/A_int4_split.json > $OUT/A_int4_split.log 2>&1
grep -E "int4pack call|Error|File \"/work" $OUT/A_int4_split.log | tail -30
