# s46 call B (GGUF part 2 travels): the whole device-round GPU suite, the warm-up test (no capture after it)
source .carry/u/setup.sh > $OUT/setup2.log 2>&1; ls /tmp/gg | tee -a $S
run R_replay 200 -n 6 tests/parity/test_replay_gpu.py -k "not builtin and not kept"
run G_all 240 -n 6 tests/parity/test_device_rounds_gpu.py
run W_warm 90 tests/parity/test_warm_up_gpu.py -k "tiny"
