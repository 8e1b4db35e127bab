# s42 lease 2 call 1: requests beside the rounds, on CUDA (tiny models)
source .carry/u/setup.sh > $OUT/setup.log 2>&1
S=$OUT/summary.log
echo "== $(date) $(nvidia-smi --query-gpu=name --format=csv,noheader)" | tee -a $S
run() { name=$1; t=$2; shift 2; timeout $t python -m pytest -q -p no:cacheprovider "$@" > $OUT/$name.log 2>&1; echo "$name rc=$?" | tee -a $S; grep -E "^FAILED|^ERROR| passed| failed" $OUT/$name.log | tail -6 | tee -a $S; }
run F_rounds 150 tests/parity/test_device_rounds_gpu.py -k "penalised or join"
run G_replay 120 tests/parity/test_replay_gpu.py -k "not builtin"
