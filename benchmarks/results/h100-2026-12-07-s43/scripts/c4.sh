# s43 call 4: llguidance; grammars beside the rounds on CUDA; mixed and no-json loads spec vs --no-spec
source .carry/u/setup.sh > $OUT/setup4.log 2>&1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .carry/wl/*.whl >> $OUT/setup4.log 2>&1
S=$OUT/summary.log
echo "== $(date)" | tee -a $S
run() { name=$1; t=$2; shift 2; timeout $t python -m pytest -q -p no:cacheprovider "$@" > $OUT/$name.log 2>&1; echo "$name rc=$?" | tee -a $S; grep -E "^FAILED|^ERROR| passed| failed" $OUT/$name.log | tail -6 | tee -a $S; }
COMMON="--serve $GG --device cuda --requests-per-level 768 --max-tokens 128 --temperature 0.8 --prompts-file benchmarks/data/heldout_prompts.jsonl --no-spec-server"
b() { name=$1; t=$2; shift 2; timeout $t python benchmarks/bench_serve.py $COMMON "$@" --out-dir $OUT/$name > $OUT/$name.log 2>&1; echo "$name rc=$?" | tee -a $S; rm -f $OUT/$name/*.png $OUT/$name/*.log; sed -n '/^| load/,/^$/p' $OUT/$name/serve.md | tee -a $S; sed -n '/^| level/,/^$/p' $OUT/$name/serve.md | tee -a $S; grep -i "by rule" -A8 $OUT/$name/serve.md | tee -a $S; }
run F_structured 150 tests/parity/test_structured_gpu.py
b M_mixed 200 --rules mixed --concurrency 16 64
b N_nojson 120 --rules no-json --concurrency 64
