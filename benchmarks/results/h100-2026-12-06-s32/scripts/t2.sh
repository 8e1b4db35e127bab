source .carry/s/setup.sh; date
timeout 250 python -m pytest -q -p no:cacheprovider tests/parity/test_replay_gpu.py -k "device_rounds_replay or speculation_replays or preempted" 2>&1 | tee $OUT/T2_replay.txt | tail -8
date
