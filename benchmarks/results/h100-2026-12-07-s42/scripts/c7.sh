# s42 lease 2 call 4: llguidance; the grammar GPU tests; the mixed load at c = 64
source .carry/u/setup.sh > /dev/null 2>&1
python3 -m pip install -q --no-index --no-deps --target /tmp/site .carry/wl/*.whl > /dev/null 2>&1
S=$OUT/summary.log
run() { name=$1; t=$2; shift 2; timeout $t python -m pytest -q -p no:cacheprovider "$@" > $OUT/$name.log 2>&1; echo "$name rc=$?" | tee -a $S; grep -E "^FAILED|^ERROR| passed| failed" $OUT/$name.log | tail -6 | tee -a $S; }
run E_struct 120 tests/parity/test_structured_gpu.py
COMMON="--serve $GG --device cuda --requests-per-level 768 --max-tokens 128 --temperature 0.8 --prompts-file benchmarks/data/heldout_prompts.jsonl --no-spec-server"
b() { name=$1; t=$2; shift 2; timeout $t python benchmarks/bench_serve.py $COMMON "$@" --out-dir $OUT/$name > $OUT/$name.log 2>&1; echo "$name rc=$?" | tee -a $S; grep -c "requests failed" $OUT/$name.log | tee -a $S; sed -n '/^| load/,/^$/p' $OUT/$name/serve.md | tee -a $S; sed -n '/^| level/,/^$/p' $OUT/$name/serve.md | tee -a $S; grep -i "by rule" -A8 $OUT/$name/serve.md | tee -a $S; rm -f $OUT/$name/serve.png; }
b M3_mixed 150 --rules mixed --concurrency 64
