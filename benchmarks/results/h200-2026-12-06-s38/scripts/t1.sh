# s38 call 1: MoE routing kernels' GPU tests; Qwen3-30B-A3B shape old (7665e26 moe.py) vs new; tile probe
source .carry/s/setup.sh > /dev/null 2>&1
S=$OUT/summary.log
echo "== $(date) $(nvidia-smi --query-gpu=name --format=csv,noheader)" >> $S
timeout 200 python -m pytest -q -x -p no:cacheprovider tests/parity/test_moe_gpu.py > $OUT/A_moe_tests.log 2>&1
echo "A tests rc=$?" >> $S; tail -4 $OUT/A_moe_tests.log >> $S
rm -rf /tmp/oldsrc && cp -r src /tmp/oldsrc && cp .carry/old_moe/moe.py /tmp/oldsrc/specdec/models/moe.py
i=0
for v in new old new old; do
  i=$((i+1)); v=$v$i
  if [ ${v:0:3} = old ]; then P=/tmp/site:/tmp/oldsrc:$PWD/tests:$PWD/benchmarks; else P=$PYTHONPATH; fi
  PYTHONPATH=$P timeout 150 python benchmarks/bench_families.py --out $OUT/B_$v --shapes qwen3-30b-a3b --batches 1,64 --new-tokens 32 > $OUT/B_$v.log 2>&1
  echo "B $v rc=$? $(python -c "import json,sys;d=json.load(open(sys.argv[1]))['qwen3-30b-a3b'];print(d['tpot_ms'],d.get('b1_over_floor'))" $OUT/B_$v/families.json 2>&1 | tail -1)" >> $S
  if [ $i = 2 ]; then timeout 100 python .carry/s/tune_moe.py $OUT/C_tune.json > $OUT/C_tune.log 2>&1; echo "C rc=$?" >> $S; cat $OUT/C_tune.log >> $S; fi
  [ $SECONDS -gt 380 ] && break
done
