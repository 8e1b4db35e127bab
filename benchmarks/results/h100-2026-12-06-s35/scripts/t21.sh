# s35 call 1: issue 40's GPU tests that need no built-in GGUF
source .carry/s/setup.sh > $OUT/setup1.log 2>&1
python -m pytest -q -n 4 -p no:cacheprovider tests/parity/test_quant_gpu.py > $OUT/quant_gpu.log 2>&1; tail -5 $OUT/quant_gpu.log
python -m pytest -q -n 4 -p no:cacheprovider tests/parity/test_replay_gpu.py -k "gguf and not builtin" > $OUT/replay_gguf.log 2>&1; tail -5 $OUT/replay_gguf.log
