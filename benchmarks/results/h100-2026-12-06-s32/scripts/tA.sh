source .carry/s/setup.sh; date
timeout 300 python -m pytest -q -p no:cacheprovider tests/parity/test_device_rounds_gpu.py -k "join or adaptive or plain_arm or logprobs" 2>&1 | tee $OUT/TA_rounds.txt | tail -4
date
