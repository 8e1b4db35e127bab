source .carry/s/setup.sh; ls -la $GG || exit 1; date
timeout 100 python -m pytest -q -p no:cacheprovider tests/parity/test_warm_up_gpu.py -k grammar 2>&1 | tail -3
B="python benchmarks/bench_serve.py --serve $GG --device cuda --max-tokens 128 --temperature 0.8 --no-spec-server"
$B --concurrency 16 64 256 --requests-per-level 256 --out-dir /tmp/o/main > $OUT/main.log 2>&1
date
$B --concurrency 1 --requests-per-level 24 --out-dir /tmp/o/c1 > $OUT/c1.log 2>&1
date
$B --concurrency 64 --requests-per-level 192 --rules mixed --out-dir /tmp/o/mixed > $OUT/mixed.log 2>&1
date
for d in main c1 mixed; do cp /tmp/o/$d/serve.json $OUT/$d.json; cat /tmp/o/$d/serve.md | grep -v "^$" | tail -n +5; done
python - <<'PY'
import json
for d in ("main", "c1", "mixed"):
    m = json.load(open(f"/tmp/o/{d}/serve.json"))["meta"]
    for k, v in m["engine_counters_by_level"].items():
        print(d, k, {a.replace("specdec:", "").replace("_total", ""): b for a, b in v.items()})
PY
