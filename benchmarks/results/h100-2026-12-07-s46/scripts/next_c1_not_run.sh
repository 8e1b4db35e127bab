# s47 call A (tiny models; GGUF part 1 travels): the head's draft logits batch invariant (14d9127): the prompt-step tests and s45's diagnosis; trees on CUDA; graphed rounds == the synchronous step
source .carry/u/setup.sh > $OUT/setup1.log 2>&1
run P_prompt 120 tests/unit/drafters/test_eagle_prompt_steps.py
timeout 200 python .carry/u/d1.py > $OUT/d1.log 2>&1; echo "d1 rc=$?" | tee -a $S; grep -v Warn $OUT/d1.log | tail -9 | tee -a $S
run T_tree 200 tests/unit/engine/test_tree_engine.py tests/unit/engine/test_structured_engine.py -k "tree"
