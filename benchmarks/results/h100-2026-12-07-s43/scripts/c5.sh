# s43 call 5: the two GPU tests fixed (test harness): kept rules, requests beside graphed rounds
source .carry/u/setup.sh > $OUT/setup5.log 2>&1
S=$OUT/summary.log
echo "== $(date) $(nvidia-smi --query-gpu=name --format=csv,noheader)" | tee -a $S
run() { name=$1; t=$2; shift 2; timeout $t python -m pytest -q -p no:cacheprovider "$@" > $OUT/$name.log 2>&1; echo "$name rc=$?" | tee -a $S; grep -E "^FAILED|^ERROR| passed| failed" $OUT/$name.log | tail -6 | tee -a $S; }
run B_rounds_beside 100 tests/parity/test_device_rounds_gpu.py -k "cannot_take"
run A_request_rules 80 tests/parity/test_request_rules_gpu.py
