# s42 call 3: GGUF joined; the server with every request penalised, and the no-json / mixed loads, spec vs --no-spec
source .carry/u/setup.sh > $OUT/setup3.log 2>&1; tail -3 $OUT/setup3.log
S=$OUT/summary.log
echo "== $(date) $(nvidia-smi --query-gpu=name --format=csv,noheader)" | tee -a $S
COMMON="--serve $GG --device cuda --requests-per-level 768 --max-tokens 128 --temperature 0.8 --prompts-file benchmarks/data/heldout_prompts.jsonl --no-spec-server"
b() { name=$1; t=$2; shift 2; timeout $t python benchmarks/bench_serve.py $COMMON "$@" --out-dir $OUT/$name > $OUT/$name.log 2>&1; echo "$name rc=$?" | tee -a $S; sed -n '/^| load/,/^$/p' $OUT/$name/serve.md | tee -a $S; sed -n '/^| level/,/^$/p' $OUT/$name/serve.md | tee -a $S; grep -i "by rule" -A8 $OUT/$name/serve.md | tee -a $S; }
b P_penalties 220 --rules penalties --concurrency 16 64 256
b N_nojson 120 --rules no-json --concurrency 64
b M_mixed 120 --rules mixed --concurrency 64
