# s39 call 3: GGUF part 3 of 3 joined; the server on the H200: spec / --no-spec / LLM.generate at c = 64, 256
source .carry/s/setup.sh > $OUT/setup4.log 2>&1; cat $OUT/setup4.log
S=$OUT/summary.log
ls -la $GG | tee -a $S
timeout 360 python benchmarks/bench_serve.py --serve $GG --device cuda --requests-per-level 384 --max-tokens 128 \
  --temperature 0.8 --prompts-file benchmarks/data/heldout_prompts.jsonl --concurrency 64 256 \
  --no-spec-server --generate --out $OUT/F_serve/serve.json > $OUT/F_serve.log 2>&1
echo "F serve rc=$?" | tee -a $S; tail -30 $OUT/F_serve.log | tee -a $S; cat $OUT/F_serve/serve.md 2>/dev/null | tee -a $S
