# s39 call 4: c = 1; the 256-stream load test; the long prompts at c = 64
source .carry/s/setup.sh > $OUT/setup5.log 2>&1
S=$OUT/summary.log
timeout 130 python benchmarks/bench_serve.py --serve $GG --device cuda --requests-per-level 24 --max-tokens 128 \
  --temperature 0.8 --prompts-file benchmarks/data/heldout_prompts.jsonl --concurrency 1 \
  --no-spec-server --out $OUT/G_serve_c1/serve.json > $OUT/G_serve_c1.log 2>&1
echo "G c=1 rc=$?" | tee -a $S; cat $OUT/G_serve_c1/serve.md 2>/dev/null | tee -a $S
timeout 150 python benchmarks/load_test_serve.py --serve $GG --device cuda --streams 256 --solo 32 --out $OUT/H_load_test.json > $OUT/H_load_test.log 2>&1
echo "H load test rc=$?" | tee -a $S; tail -15 $OUT/H_load_test.log | tee -a $S
[ $SECONDS -lt 400 ] && timeout $((560 - SECONDS)) python benchmarks/bench_serve.py --serve $GG --device cuda --requests-per-level 192 --max-tokens 128 \
  --temperature 0.8 --prompts-file benchmarks/data/long_prompts.jsonl --concurrency 64 \
  --no-spec-server --out $OUT/I_serve_long/serve.json > $OUT/I_serve_long.log 2>&1
echo "I long rc=$?" | tee -a $S; cat $OUT/I_serve_long/serve.md 2>/dev/null | tee -a $S
