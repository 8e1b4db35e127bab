# s40 call 4: the 256-stream load test; c = 1 spec / --no-spec
source .carry/s/setup.sh > $OUT/setup5.log 2>&1
S=$OUT/summary.log
timeout 170 python benchmarks/load_test_serve.py --serve $GG --device cuda --streams 256 --solo 32 --out $OUT/H_load_test.json > $OUT/H_load_test.log 2>&1
echo "H load test rc=$?" | tee -a $S; tail -20 $OUT/H_load_test.log | tee -a $S
timeout 150 python benchmarks/bench_serve.py --serve $GG --device cuda --requests-per-level 24 --max-tokens 128 \
  --temperature 0.8 --prompts-file benchmarks/data/heldout_prompts.jsonl --concurrency 1 \
  --no-spec-server --out $OUT/G_serve_c1/serve.json > $OUT/G_serve_c1.log 2>&1
echo "G c=1 rc=$?" | tee -a $S; tail -5 $OUT/G_serve_c1.log | tee -a $S; cat $OUT/G_serve_c1/serve.md 2>/dev/null | tee -a $S
