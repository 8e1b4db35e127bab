# s46 call D: in process at c = 16 with the admission share 16 / 8 / 4 (the prompt graphs); the built-in replay suite; the load test
source .carry/u/setup.sh > $OUT/setup4.log 2>&1
timeout 200 python benchmarks/probes/probe_joining_rounds.py --gguf $GG --out $OUT/J16 --concurrency 16 --requests 384 --admission-share 16,4 > $OUT/J16.log 2>&1; echo "J16 rc=$?" | tee -a $S; tail -25 $OUT/J16.log | cut -c1-220 | tee -a $S
run R_builtin 150 -n 4 tests/parity/test_replay_gpu.py -k "builtin"
timeout 200 python benchmarks/load_test_serve.py --serve $GG --device cuda --streams 256 --solo 32 > $OUT/L_load.log 2>&1; echo "L_load rc=$?" | tee -a $S; tail -12 $OUT/L_load.log | tee -a $S
