# s41 call 3: GGUF part 3 joined; the server: default spec, spec with the plain arm, --no-spec, LLM.generate at c = 16, 64, 256 (no generate: call 4)
source .carry/s/setup.sh > $OUT/setup3.log 2>&1; cat $OUT/setup3.log
S=$OUT/summary.log
ls -la $GG | tee -a $S
echo "== $(date) $(git log --oneline | head -1)" | tee -a $S
COMMON="--serve $GG --device cuda --requests-per-level 768 --max-tokens 128 --temperature 0.8 --prompts-file benchmarks/data/heldout_prompts.jsonl --concurrency 16 64 256"
timeout 280 python benchmarks/bench_serve.py $COMMON --no-spec-server --out-dir $OUT/F_serve_default > $OUT/F_serve_default.log 2>&1
echo "F default rc=$?" | tee -a $S; cat $OUT/F_serve_default/*.md 2>/dev/null | tee -a $S; tail -5 $OUT/F_serve_default.log | tee -a $S
timeout 200 python benchmarks/bench_serve.py $COMMON \
  --speculative-config '{"method": "eagle", "num_speculative_tokens": 4, "plain_arm": true}' --out-dir $OUT/P_serve_plain_arm > $OUT/P_serve_plain_arm.log 2>&1
echo "P plain arm rc=$?" | tee -a $S; cat $OUT/P_serve_plain_arm/*.md 2>/dev/null | tee -a $S; tail -5 $OUT/P_serve_plain_arm.log | tee -a $S
