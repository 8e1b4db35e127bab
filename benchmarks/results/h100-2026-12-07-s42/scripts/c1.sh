# s42 call 1: slot rules in graphed rounds (tiny models), the ruled warm-up, replay (no GGUF)
source .carry/u/setup.sh > $OUT/setup.log 2>&1
S=$OUT/summary.log
echo "== $(date) $(nvidia-smi --query-gpu=name --format=csv,noheader) $(git log --oneline -1 2>/dev/null)" | tee -a $S
run() { name=$1; t=$2; shift 2; timeout $t python -m pytest -q -p no:cacheprovider "$@" > $OUT/$name.log 2>&1; echo "$name rc=$?" | tee -a $S; grep -E "^FAILED|^ERROR| passed| failed" $OUT/$name.log | tail -6 | tee -a $S; }
run A_ruled 150 tests/parity/test_device_rounds_gpu.py -k "penalised or join"
run B_warm_tiny 100 tests/parity/test_warm_up_gpu.py -k tiny
run C_replay 120 tests/parity/test_replay_gpu.py -k "not builtin"
