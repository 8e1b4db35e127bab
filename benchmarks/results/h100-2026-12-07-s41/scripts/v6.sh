# s41 lease 2: setup only (a GGUF part)
source .carry/t/setup.sh > $OUT/setup.log 2>&1; tail -2 $OUT/setup.log
