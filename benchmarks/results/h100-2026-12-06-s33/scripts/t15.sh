# s33 H200: batch-invariance tests and the tiny models' replay suite with the order-sensitive check
source .carry/s/setup.sh > /dev/null
date
timeout 60 python -m pytest -q -n 4 tests/parity/test_batch_invariance_gpu.py > $OUT/A_batch_inv_h200.log 2>&1; tail -2 $OUT/A_batch_inv_h200.log
timeout 130 python -m pytest -q -n 6 tests/parity/test_replay_gpu.py -k "not builtin" > $OUT/B_replay_tiny_h200.log 2>&1; tail -4 $OUT/B_replay_tiny_h200.log
date
