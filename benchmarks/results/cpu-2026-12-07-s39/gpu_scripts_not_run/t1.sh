# s39 call 1: GGUF part 1 of 3 (xz) and the wheels
source .carry/s/setup.sh > $OUT/setup1.log 2>&1; tail -2 $OUT/setup1.log
echo "== $(date) $(nvidia-smi --query-gpu=name --format=csv,noheader)" | tee -a $OUT/summary.log
