# s38 call 3: router on tensor cores + deep decode tiles: tests, tile A/B, families
source .carry/s/setup.sh > /dev/null 2>&1
S=$OUT/summary.log
echo "== $(date) $(nvidia-smi --query-gpu=name --format=csv,noheader)" >> $S
timeout 150 python -m pytest -q -x -p no:cacheprovider tests/parity/test_moe_gpu.py "tests/parity/test_batch_invariance_gpu.py::test_gemm_rows_do_not_depend_on_row_count_or_tile" tests/parity/test_batch_invariance_gpu.py::test_dispatch_rows_equal_alone_and_negative_control > $OUT/A_tests.log 2>&1
echo "A tests rc=$?" >> $S; tail -3 $OUT/A_tests.log >> $S; grep -E "^(FAILED|ERROR)" $OUT/A_tests.log >> $S
timeout 90 python .carry/s/tiles_ab.py $OUT/B_tiles.json > $OUT/B_tiles.log 2>&1; echo "B rc=$?" >> $S; cat $OUT/B_tiles.log >> $S
for i in 1 2; do
  timeout 100 python benchmarks/bench_families.py --out $OUT/C_moe$i --shapes qwen3-30b-a3b --batches 1,64 --new-tokens 32 > $OUT/C_moe$i.log 2>&1
  echo "C moe$i rc=$? $(python -c "import json,sys;d=json.load(open(sys.argv[1]))['qwen3-30b-a3b'];print(d['tpot_ms'],d.get('b1_over_floor'))" $OUT/C_moe$i/families.json 2>&1 | tail -1)" >> $S
done
timeout 150 python benchmarks/probes/probe_family_kernels.py --out $OUT/D --shapes qwen3-30b-a3b --steps 8 > $OUT/D.log 2>&1; echo "D rc=$?" >> $S; grep -A12 "kernels\]" $OUT/D.log >> $S
[ $SECONDS -lt 400 ] && timeout 170 python benchmarks/bench_families.py --out $OUT/E --shapes llama-3-8b,qwen3-8b,gemma-2-9b --batches 1 --new-tokens 32 > $OUT/E.log 2>&1; echo "E rc=$?" >> $S; python -c "
import json,sys;d=json.load(open(sys.argv[1]))
for k,v in d.items():
  if isinstance(v,dict) and 'tpot_ms' in v: print(k, {a:round(b,3) for a,b in v.items() if not isinstance(b,(dict,list))}, v['tpot_ms'])" $OUT/E/families.json >> $S 2>&1
