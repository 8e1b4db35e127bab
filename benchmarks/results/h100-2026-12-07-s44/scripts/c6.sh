# s44 call 6: the admission's prompt entries through the head's "prompt" graphs: graphed rounds == the synchronous step (standard / block / coupled), joins, warm-up (no capture after it), and the admission's host time
export PYTHONPATH=$PWD/src:$PWD/tests:$PWD/benchmarks/probes:$PWD/benchmarks PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/triton_cache
S=$OUT/summary.log
echo "== $(date) $(nvidia-smi --query-gpu=name --format=csv,noheader)" | tee -a $S
run() { name=$1; t=$2; shift 2; timeout $t python -m pytest -q -p no:cacheprovider "$@" > $OUT/$name.log 2>&1; echo "$name rc=$?" | tee -a $S; grep -E "^FAILED|^ERROR| passed| failed" $OUT/$name.log | tail -8 | tee -a $S; }
run G_rounds 110 -n 8 tests/parity/test_device_rounds_gpu.py tests/unit/drafters/test_eagle_prompt_steps.py -k "emit_what_the_synchronous_step_emits or join or cannot_take or prompt_steps"
timeout 75 python benchmarks/probes/probe_round_syncs.py --out $OUT/S2 --requests 48 > $OUT/S2.log 2>&1; echo "S2 rc=$?" | tee -a $S; grep "^\[parts_host\]\|^\[syncs\] " $OUT/S2.log | cut -c1-200 | tee -a $S
run W_warm 70 tests/parity/test_warm_up_gpu.py -k "no_graph and tiny"
