# s43 call 2: GGUF part 2; the rest of the device-round GPU tests, the tiny warm-up
source .carry/u/setup.sh > $OUT/setup2.log 2>&1
S=$OUT/summary.log
echo "== $(date)" | tee -a $S
run() { name=$1; t=$2; shift 2; timeout $t python -m pytest -q -p no:cacheprovider "$@" > $OUT/$name.log 2>&1; echo "$name rc=$?" | tee -a $S; grep -E "^FAILED|^ERROR| passed| failed" $OUT/$name.log | tail -6 | tee -a $S; }
run F_structured 100 tests/parity/test_structured_gpu.py -k beside
