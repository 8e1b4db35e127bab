# s37 call 1: --no-spec server at c = 64 / 256 (768 chats, 128 tokens, T = 0.8): s36's runner (old) against the
# split mixed step (new; w32: chunks of 32), each with outputs every step (interval 0) and every 4 ms (the default), alternating; then LLM.chat plain
source .carry/s/setup.sh > $OUT/setup.log 2>&1; date
[ -d /tmp/sm ] || python benchmarks/make_checkpoint.py smollm2-135m --out /tmp/sm --device cuda --tokenizer-json .carry/tok/tokenizer.json 2>&1 | tail -1
python3 -c "import opentelemetry" 2>/dev/null || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .carry/w/opentelemetry*.whl
rm -rf /tmp/old /tmp/w32 && mkdir -p /tmp/old /tmp/w32 && cp -r src/specdec /tmp/old/ && cp .carry/old/*.py /tmp/old/specdec/runner/
cp -r src/specdec /tmp/w32/ && sed -i 's/^PREFILL_GRAPH_WIDTH = 16$/PREFILL_GRAPH_WIDTH = 32/' /tmp/w32/specdec/engine/config.py && grep -n "^PREFILL_GRAPH_WIDTH" /tmp/w32/specdec/engine/config.py
BASE=$PYTHONPATH; PORT=8731; mkdir -p $OUT/res; START=$(date +%s)
RUNS=${RUNS:-1 2}; CFGS=${CFGS:-old:0 new:0 new:4 old:4 w32:4}; LIMIT=${LIMIT:-480}
for run in $RUNS; do for cfg in $CFGS; do
  [ $run = 2 ] && { [ $cfg = new:0 ] || [ $cfg = old:4 ]; } && continue
  [ $(( $(date +%s) - START )) -gt $LIMIT ] && { echo "out of time before $cfg run $run" >> $OUT/summary.log; break 2; }
  code=${cfg%:*}; ms=${cfg#*:}; tag=${code}_${ms}ms_run$run
  case $code in old) export PYTHONPATH=/tmp/old:$BASE;; w32) export PYTHONPATH=/tmp/w32:$BASE;; *) export PYTHONPATH=$BASE;; esac
  python -c "import specdec.runner.model_runner as m; print(m.__file__)" >> $OUT/res/which.txt
  SPECDEC_STREAM_INTERVAL_MS=$ms timeout 200 python -m specdec serve /tmp/sm --device cuda --no-spec --port $PORT > $OUT/res/srv_$tag.log 2>&1 &
  SPID=$!; t0=$(date +%s)
  for i in $(seq 1 300); do kill -0 $SPID 2>/dev/null || break; curl -s -o /dev/null -w "%{http_code}" http://127.0.0.1:$PORT/health 2>/dev/null | grep -q 200 && break; sleep 0.5; done
  curl -s http://127.0.0.1:$PORT/metrics | grep -E "^specdec:num_" > /tmp/m0.txt
  timeout 150 python benchmarks/bench_serve.py --url http://127.0.0.1:$PORT --plain-only --concurrency 64 256 --requests-per-level 768 --max-tokens 128 --temperature 0.8 --prompts-file benchmarks/data/heldout_prompts.jsonl --warmup-requests 2 --out $OUT/res/serve_$tag.json > $OUT/res/bp_$tag.log 2>&1
  curl -s http://127.0.0.1:$PORT/metrics | grep -E "^specdec:num_" > /tmp/m1.txt
  (echo "== $tag ready after $(( $(date +%s) - t0 ))s (incl. bench) $(date +%T)"; grep "c=" $OUT/res/bp_$tag.log; paste /tmp/m0.txt /tmp/m1.txt | awk '$4-$2 != 0 {print $1, $4-$2}') >> $OUT/summary.log
  kill $SPID; wait $SPID 2>/dev/null; sleep 1
done; done
export PYTHONPATH=$BASE
[ -n "$NOGEN" ] || timeout 120 python .carry/s/gen.py /tmp/sm cuda 768 plain 2>&1 | tail -1 | cut -c1-300 | tee -a $OUT/summary.log
cat $OUT/summary.log; date
