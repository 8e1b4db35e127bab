# s42 lease 2 call 2: GGUF part 2 only
source .carry/u/setup.sh > $OUT/setup2.log 2>&1; tail -1 $OUT/setup2.log
