cd /tmp/exp
export PYTHONPATH=/tmp/exp/src
PY=/work/main/.venv/bin/python
OUT=/tmp/sharpen; mkdir -p $OUT
$PY -m specdec.cli bench --sweep --drafter std='{"method":"eagle","rejection_sample_method":"standard","adaptive":false}' --ks 4 --temperatures 0.7,1.0 --prompts-file benchmarks/data/heldout_prompts.jsonl --num-prompts 16 --output-len 128 --threads 1 --out $OUT/std.json > $OUT/std.log 2>&1
for b in 1.0 1.3 1.6 0.8; do
SPECDEC_SHARPEN=$b $PY -m specdec.cli bench --sweep --drafter cpl$b='{"method":"eagle","rejection_sample_method":"coupled","adaptive":false}' --ks 4 --temperatures 0.7,1.0 --prompts-file benchmarks/data/heldout_prompts.jsonl --num-prompts 16 --output-len 128 --threads 1 --out $OUT/cpl$b.json > $OUT/cpl$b.log 2>&1
done
