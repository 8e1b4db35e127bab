# s43 call 3: GGUF joined; the server spec vs --no-spec: no rules, every request penalised (kept rules on the plain side)
source .carry/u/setup.sh > $OUT/setup3.log 2>&1; tail -3 $OUT/setup3.log
S=$OUT/summary.log
echo "== $(date) $(nvidia-smi --query-gpu=name --format=csv,noheader)" | tee -a $S
COMMON="--serve $GG --device cuda --requests-per-level 768 --max-tokens 128 --temperature 0.8 --prompts-file benchmarks/data/heldout_prompts.jsonl --no-spec-server"
b() { name=$1; t=$2; shift 2; timeout $t python benchmarks/bench_serve.py $COMMON "$@" --out-dir $OUT/$name > $OUT/$name.log 2>&1; echo "$name rc=$?" | tee -a $S; rm -f $OUT/$name/*.png $OUT/$name/*.log; sed -n '/^| load/,/^$/p' $OUT/$name/serve.md | tee -a $S; sed -n '/^| level/,/^$/p' $OUT/$name/serve.md | tee -a $S; grep -i "by rule" -A8 $OUT/$name/serve.md | tee -a $S; }
b Z_no_rules 200 --concurrency 16 64 256
b M_mixed 150 --rules mixed --concurrency 64
b P_penalties 120 --rules penalties --concurrency 64
