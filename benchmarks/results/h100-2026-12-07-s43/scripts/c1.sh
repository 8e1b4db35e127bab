# s43 call 1: wheels + GGUF part 1; tiny-model GPU tests: kept rules, requests beside the rounds, replay
source .carry/u/setup.sh > $OUT/setup.log 2>&1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .carry/wl/*.whl >> $OUT/setup.log 2>&1
S=$OUT/summary.log
echo "== $(date) $(nvidia-smi --query-gpu=name --format=csv,noheader)" | tee -a $S
run() { name=$1; t=$2; shift 2; timeout $t python -m pytest -q -p no:cacheprovider "$@" > $OUT/$name.log 2>&1; echo "$name rc=$?" | tee -a $S; grep -E "^FAILED|^ERROR| passed| failed" $OUT/$name.log | tail -6 | tee -a $S; }
run A_request_rules 100 tests/parity/test_request_rules_gpu.py
run B_rounds_beside 120 tests/parity/test_device_rounds_gpu.py -k "cannot_take"
