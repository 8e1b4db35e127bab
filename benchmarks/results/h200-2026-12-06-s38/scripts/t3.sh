# s38 call 3 (budget-cut): tests, MoE A/B (s37 / routing kernels / + router), bf16 family parity, census, tiles, dense families
source .carry/s/setup.sh > /dev/null 2>&1
S=$OUT/summary.log
echo "== $(date) $(nvidia-smi --query-gpu=name --format=csv,noheader)" >> $S
timeout 120 python -m pytest -q -x -p no:cacheprovider tests/parity/test_moe_gpu.py "tests/parity/test_batch_invariance_gpu.py::test_gemm_rows_do_not_depend_on_row_count_or_tile" > $OUT/A_tests.log 2>&1
echo "A tests rc=$? t=$SECONDS" >> $S; tail -2 $OUT/A_tests.log >> $S; grep -E "^(FAILED|ERROR)" $OUT/A_tests.log >> $S
for c in 7665e26 057c938; do rm -rf /tmp/o_$c && cp -r src /tmp/o_$c && cp .carry/o_$c/*.py /tmp/o_$c/specdec/models/; done
for v in new o_7665e26 o_057c938; do
  if [ $v = new ]; then P=$PYTHONPATH; else P=/tmp/site:/tmp/$v:$PWD/tests:$PWD/benchmarks; fi
  PYTHONPATH=$P timeout 60 python benchmarks/bench_families.py --out $OUT/C_$v --shapes qwen3-30b-a3b --batches 1,64 --new-tokens 32 > $OUT/C_$v.log 2>&1
  echo "C $v rc=$? t=$SECONDS $(python -c "import json,sys;d=json.load(open(sys.argv[1]))['qwen3-30b-a3b'];print(d['tpot_ms'],d.get('b1_over_floor'))" $OUT/C_$v/families.json 2>&1 | tail -1)" >> $S
done
timeout 150 python -m pytest tests/parity/test_families_bf16_gpu.py -s -q -p no:cacheprovider > $OUT/F_families_bf16.log 2>&1; echo "F rc=$? t=$SECONDS" >> $S; grep -E "prompts equal|passed|failed" $OUT/F_families_bf16.log | tail -20 >> $S
[ $SECONDS -lt 330 ] && { timeout 50 python benchmarks/probes/probe_family_kernels.py --out $OUT/D --shapes qwen3-30b-a3b --steps 8 > $OUT/D.log 2>&1; echo "D rc=$? t=$SECONDS" >> $S; grep -A12 "kernels\]" $OUT/D.log >> $S; }
[ $SECONDS -lt 360 ] && { timeout 40 python .carry/s/tiles_ab.py $OUT/B_tiles.json > $OUT/B_tiles.log 2>&1; echo "B rc=$? t=$SECONDS" >> $S; cat $OUT/B_tiles.log >> $S; }
echo "end t=$SECONDS" >> $S
