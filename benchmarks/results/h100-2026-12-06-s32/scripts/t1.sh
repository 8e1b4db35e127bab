source .carry/s/setup.sh; git log -1 --format=%h 2>/dev/null; date
timeout 280 python -m pytest -q -x -p no:cacheprovider tests/parity/test_device_rounds_gpu.py -k "carry_logprobs or join" 2>&1 | tee $OUT/T1_rounds.txt | tail -15
date
timeout 150 python -m pytest -q -p no:cacheprovider tests/parity/test_warm_up_gpu.py -k grammar 2>&1 | tee $OUT/T1_warm.txt | tail -8
date
