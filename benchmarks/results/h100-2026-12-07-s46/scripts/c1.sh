# s46 call A (tiny models; GGUF part 1 travels): the head's general step on the decode kernels (fc473b4), graphed rounds, the tiny replay suite
source .carry/u/setup.sh > $OUT/setup1.log 2>&1
timeout 100 python .carry/u/d1.py > $OUT/d1.log 2>&1; echo "d1 rc=$?" | tee -a $S; grep -v Warn $OUT/d1.log | tail -10 | tee -a $S
run P_prompt 90 tests/unit/drafters/test_eagle_prompt_steps.py
run G_rounds 150 -n 6 tests/parity/test_device_rounds_gpu.py -k "emit_what_the_synchronous_step_emits or join or cannot_take or penalised"
run T_tree 150 tests/unit/engine/test_tree_engine.py tests/unit/engine/test_structured_engine.py -k "tree"
