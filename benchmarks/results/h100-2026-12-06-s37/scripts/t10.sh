# s37 call 1 (budget-limited): one run of each server configuration (t8.sh), LLM.chat plain, then the GPU replay suite (not the built-in GGUF's cases) in what time is left
T0=$(date +%s)
RUNS=1 CFGS="old:0 new:4 new:0 w32:4" LIMIT=250 bash .carry/s/t8.sh
source .carry/s/setup.sh > /dev/null 2>&1
LEFT=$(( 585 - ($(date +%s) - T0) ))
echo "replay suite with ${LEFT}s left" | tee -a $OUT/summary.log
[ $LEFT -gt 60 ] && timeout $LEFT python -m pytest -q -n 6 -p no:cacheprovider tests/parity/test_replay_gpu.py -k "not builtin" 2>&1 | tail -30 | tee $OUT/replay_gpu.log
date
