source .carry/s/setup.sh
ls -la $GG || exit 1
date
bash .carry/s/profile_serve.sh nospec 64 512 P64 > $OUT/P64.txt 2>&1; tail -40 $OUT/P64.txt
date
python benchmarks/bench_serve.py --serve $GG --device cuda --concurrency 16 64 256 --requests-per-level 256 --max-tokens 128 --temperature 0.8 --no-spec-server --out-dir $OUT/serve_main > $OUT/serve_main.log 2>&1
grep -A12 "| load |" $OUT/serve_main/serve.md
date
python benchmarks/bench_serve.py --serve $GG --device cuda --concurrency 1 --requests-per-level 24 --max-tokens 128 --temperature 0.8 --no-spec-server --out-dir $OUT/serve_c1 > $OUT/serve_c1.log 2>&1
grep -A4 "| load |" $OUT/serve_c1/serve.md
date
python benchmarks/bench_serve.py --serve $GG --device cuda --concurrency 64 256 --requests-per-level 256 --max-tokens 128 --temperature 0.8 --generate --out-dir $OUT/serve_gen > $OUT/serve_gen.log 2>&1
grep -A6 "| load |" $OUT/serve_gen/serve.md
date
