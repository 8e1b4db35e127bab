# s33 call C: the built-in model's replay suite and the 256-stream load test on the landed code
source .carry/s/setup.sh > /dev/null; ls -la $GG || exit 1
date
timeout 200 python -m pytest -q -n 4 tests/parity/test_replay_gpu.py -k builtin > $OUT/A_replay_builtin.log 2>&1; tail -8 $OUT/A_replay_builtin.log | grep -v "^[0-9.]*s call"
date
timeout 240 python benchmarks/load_test_serve.py --serve $GG --device cuda --streams 256 --solo 32 --out $OUT/B_load_test.json > $OUT/B_load_test.log 2>&1; echo rc $?; tail -15 $OUT/B_load_test.log
date
