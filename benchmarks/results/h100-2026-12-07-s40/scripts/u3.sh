# s40 call 3: GGUF part 3 joined; generate's warm-up test; the server on the GPU: spec / --no-spec / LLM.generate at c = 64, 256
source .carry/s/setup.sh > $OUT/setup3.log 2>&1; cat $OUT/setup3.log
S=$OUT/summary.log
ls -la $GG | tee -a $S
timeout 70 python -m pytest -q -p no:cacheprovider tests/parity/test_warm_up_gpu.py -k generate > $OUT/A_generate_warm_up.log 2>&1
echo "A generate warm-up rc=$?" | tee -a $S; tail -3 $OUT/A_generate_warm_up.log | tee -a $S
timeout 400 python benchmarks/bench_serve.py --serve $GG --device cuda --requests-per-level 384 --max-tokens 128 \
  --temperature 0.8 --prompts-file benchmarks/data/heldout_prompts.jsonl --concurrency 64 256 \
  --no-spec-server --generate --out-dir $OUT/F_serve > $OUT/F_serve.log 2>&1
echo "F serve rc=$?" | tee -a $S; tail -30 $OUT/F_serve.log | tee -a $S; cat $OUT/F_serve/*.md 2>/dev/null | tee -a $S
