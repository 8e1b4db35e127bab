# s35 call 2: GGUF part 2 arrives; the quantized kernel suite once more under -n 2 (quick)
source .carry/s/setup.sh > $OUT/setup2.log 2>&1; tail -2 $OUT/setup2.log
