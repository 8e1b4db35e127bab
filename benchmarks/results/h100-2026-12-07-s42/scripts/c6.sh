# s42 lease 2 call 3: GGUF joined; mixed and no-json at c = 64, no rules at 16/64/256: spec vs --no-spec
source .carry/u/setup.sh > $OUT/setup3.log 2>&1; tail -2 $OUT/setup3.log
S=$OUT/summary.log
echo "== $(date) $(nvidia-smi --query-gpu=name --format=csv,noheader)" | tee -a $S
COMMON="--serve $GG --device cuda --requests-per-level 768 --max-tokens 128 --temperature 0.8 --prompts-file benchmarks/data/heldout_prompts.jsonl --no-spec-server"
b() { name=$1; t=$2; shift 2; timeout $t python benchmarks/bench_serve.py $COMMON "$@" --out-dir $OUT/$name > $OUT/$name.log 2>&1; echo "$name rc=$?" | tee -a $S; grep -c "requests failed" $OUT/$name.log | tee -a $S; sed -n '/^| load/,/^$/p' $OUT/$name/serve.md | tee -a $S; sed -n '/^| level/,/^$/p' $OUT/$name/serve.md | tee -a $S; grep -i "by rule" -A8 $OUT/$name/serve.md | tee -a $S; rm -f $OUT/$name/serve.png; }
b Y_norules 200 --concurrency 64 --generate
