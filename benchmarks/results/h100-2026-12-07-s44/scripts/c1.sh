# s44 call 1: wheels + GGUF part 1; the GPU tests fixed after s43's lease; the tiny models' replay suite
source .carry/u/setup.sh > $OUT/setup1.log 2>&1
run A_request_rules 150 tests/parity/test_request_rules_gpu.py
run B_rounds_beside 150 tests/parity/test_device_rounds_gpu.py -k "cannot_take"
run C_replay_tiny 240 -n 4 tests/parity/test_replay_gpu.py -k "not builtin"
