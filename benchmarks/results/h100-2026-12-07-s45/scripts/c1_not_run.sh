# s45 call A (tiny models, no GGUF): the head's general step on the decode kernels (fc473b4): which path differs (d1.py), the prompt-step tests; graphed rounds == the synchronous step
source .carry/u/setup.sh > $OUT/setup1.log 2>&1
timeout 100 python .carry/u/d1.py > $OUT/d1.log 2>&1; echo "d1 rc=$?" | tee -a $S; grep -v Warn $OUT/d1.log | tail -10 | tee -a $S
run P_prompt 90 tests/unit/drafters/test_eagle_prompt_steps.py
run G_rounds 120 -n 6 tests/parity/test_device_rounds_gpu.py -k "emit_what_the_synchronous_step_emits or join"
