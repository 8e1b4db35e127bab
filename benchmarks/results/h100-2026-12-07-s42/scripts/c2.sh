# s42 call 2: GGUF part 2; the rest of the device-round GPU tests
source .carry/u/setup.sh > $OUT/setup2.log 2>&1
S=$OUT/summary.log
echo "== $(date)" | tee -a $S
run() { name=$1; t=$2; shift 2; timeout $t python -m pytest -q -p no:cacheprovider "$@" > $OUT/$name.log 2>&1; echo "$name rc=$?" | tee -a $S; grep -E "^FAILED|^ERROR| passed| failed" $OUT/$name.log | tail -6 | tee -a $S; }
run D_rounds 400 tests/parity/test_device_rounds_gpu.py -k "not penalised and not join"
