# s44 call 3: GGUF joined; in-process c = 16 arrivals profile (spec vs plain, parts timed, admission share); json-heavy server load; built-in replay
source .carry/u/setup.sh > $OUT/setup3.log 2>&1; tail -2 $OUT/setup3.log | tee -a $S
timeout 200 python benchmarks/probes/probe_joining_rounds.py --gguf $GG --out $OUT/P_joining --concurrency 16 --requests 384 --admission-share 16,2 > $OUT/P_joining.log 2>&1; echo "P_joining rc=$?" | tee -a $S; grep "^\[joining\]\|^   " $OUT/P_joining.log | tee -a $S
b J_jsonheavy 200 --requests-per-level 768 --rules json-heavy --concurrency 64
run R_replay_builtin 150 -n 4 tests/parity/test_replay_gpu.py -k builtin
