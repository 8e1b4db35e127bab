# s34 call 2: kept-quantized CUDA weights: prompt rows through the dequantized GEMM, the rest
# through the kernel (quant tests, the tiny GGUF model's replay suite with long prompts and its
# negative control), then the engine's prefill / decode / joining times before and after
source .carry/s/setup.sh > /dev/null
date; START=${START:-$(date +%s)}
timeout 150 python -m pytest -q -n 4 tests/parity/test_quant_gpu.py > $OUT/A_quant.log 2>&1; tail -4 $OUT/A_quant.log | grep -v "^[0-9.]*s \(call\|setup\)"
date; START=${START:-$(date +%s)}
timeout 200 python -m pytest -q -n 4 tests/parity/test_replay_gpu.py -k "gguf or quantized" > $OUT/B_replay_gguf.log 2>&1; tail -8 $OUT/B_replay_gguf.log | grep -v "^[0-9.]*s \(call\|setup\)"
date; START=${START:-$(date +%s)}
for V in base new base new; do
  if [ $V = base ]; then PP=/tmp/site:$PWD/.carry/v/base/src:$PWD/benchmarks; else PP=$PYTHONPATH; fi
  PYTHONPATH=$PP timeout 150 python benchmarks/probes/probe_quant_steps.py --out $OUT/C_steps_$V.json 2>&1 | grep -E "int4|fp8|Error" | tail -3
  [ $(date +%s) -gt $(( START + 540 )) ] && break
done
date; START=${START:-$(date +%s)}
