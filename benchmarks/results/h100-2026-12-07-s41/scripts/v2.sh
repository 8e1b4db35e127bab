# s41 call 2: GGUF part 2 of 3; replay on the GPU (joining, preemption, server) through the one overlapped loop
source .carry/s/setup.sh > $OUT/setup2.log 2>&1; tail -1 $OUT/setup2.log
S=$OUT/summary.log
echo "== $(date) $(git log --oneline | head -1)" | tee -a $S
timeout 280 python -m pytest -q -p no:cacheprovider tests/parity/test_replay_gpu.py > $OUT/R_replay_gpu.log 2>&1
echo "R replay GPU rc=$?" | tee -a $S; grep -E "^FAILED|passed|failed" $OUT/R_replay_gpu.log | tail -8 | tee -a $S
