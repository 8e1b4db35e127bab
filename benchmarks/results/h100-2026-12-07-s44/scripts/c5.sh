# s44 call 5: the 256-stream load test
source .carry/u/setup.sh > $OUT/setup5.log 2>&1
timeout 240 python benchmarks/load_test_serve.py --serve $GG --device cuda --streams 256 --solo 32 > $OUT/L_load.log 2>&1; echo "L_load rc=$?" | tee -a $S; tail -15 $OUT/L_load.log | tee -a $S
