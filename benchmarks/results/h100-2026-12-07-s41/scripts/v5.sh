# s41 lease 2, call 3: GGUF part 3 joined; the server after f92236b (joins gathered): default spec and --no-spec at c = 16, 64, 256; then with every arrival joining the rounds (no drain, burst_always.patch)
source .carry/t/setup.sh > $OUT/setup3.log 2>&1; cat $OUT/setup3.log
S=$OUT/summary.log
echo "== $(date) $(nvidia-smi --query-gpu=name --format=csv,noheader)" | tee -a $S
COMMON="--serve $GG --device cuda --requests-per-level 768 --max-tokens 128 --temperature 0.8 --prompts-file benchmarks/data/heldout_prompts.jsonl --concurrency 16 64 256"
timeout 200 python benchmarks/bench_serve.py $COMMON --no-spec-server --out-dir $OUT/J_serve_gathered > $OUT/J_serve_gathered.log 2>&1
echo "J gathered rc=$?" | tee -a $S; sed -n '/^| load/,/^$/p' $OUT/J_serve_gathered/serve.md | tee -a $S; sed -n '/^| level/,/^$/p' $OUT/J_serve_gathered/serve.md | tee -a $S
patch -p1 < .carry/t/burst_always.patch | tee -a $S
timeout 150 python benchmarks/bench_serve.py $COMMON --out-dir $OUT/K_serve_burst_always > $OUT/K_serve_burst_always.log 2>&1
echo "K burst always rc=$?" | tee -a $S; sed -n '/^| load/,/^$/p' $OUT/K_serve_burst_always/serve.md | tee -a $S; sed -n '/^| level/,/^$/p' $OUT/K_serve_burst_always/serve.md | tee -a $S
python3 - <<'PY' | tee -a $S
import json
for name in ("J_serve_gathered", "K_serve_burst_always"):
    try:
        d = json.load(open(f"/root/out/{name}/serve.json".replace("/root/out", __import__("os").environ["OUT"])))
    except Exception as e:
        print(name, e); continue
    for lv, c in d["meta"]["engine_counters_by_level"].items():
        if lv.startswith("spec"):
            print(name, lv, {k.split("[")[-1]: v for k, v in c.items() if "k_chosen" in k or "joins" in k})
PY
