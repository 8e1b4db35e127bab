source .carry/s/setup.sh; date
timeout 250 python -m pytest -q -p no:cacheprovider tests/parity/test_replay_gpu.py -k "device_rounds_replay or speculation_replays or preempted or arrival" 2>&1 | tee $OUT/TB_replay.txt | tail -4
date
