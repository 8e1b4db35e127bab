# s35 call 3: built-in GGUF joined; the kept-quantized head test and the built-in replay tests
source .carry/s/setup.sh > $OUT/setup3.log 2>&1; cat $OUT/setup3.log
python -m pytest -q -n 4 -p no:cacheprovider tests/parity/test_replay_gpu.py -k "kept_quantized" > $OUT/replay_builtin.log 2>&1; tail -8 $OUT/replay_builtin.log
