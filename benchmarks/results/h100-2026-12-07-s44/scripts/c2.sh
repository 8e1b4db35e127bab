# s44 call 2: GGUF part 2; device rounds joining, penalised; structured outputs on CUDA
source .carry/u/setup.sh > $OUT/setup2.log 2>&1
run D_rounds_join 240 -n 4 tests/parity/test_device_rounds_gpu.py -k "penalised or join"
run E_structured 200 -n 2 tests/parity/test_structured_gpu.py
