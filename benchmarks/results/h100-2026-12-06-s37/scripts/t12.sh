# s37 call 4: the --no-spec server (split step) at c = 64 / 256 with uvicorn's HTTP parser h11 (what `pip install specdec` brings)
# against httptools (uvicorn[standard]), outputs every 4 ms, and every 2 ms with httptools; alternating, two runs
source .carry/s/setup.sh > $OUT/setup.log 2>&1; date
[ -d /tmp/sm ] || python benchmarks/make_checkpoint.py smollm2-135m --out /tmp/sm --device cuda --tokenizer-json .carry/tok/tokenizer.json 2>&1 | tail -1
python3 -c "import opentelemetry" 2>/dev/null || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .carry/w/opentelemetry*.whl
[ -d /tmp/ht ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/ht .carry/w2/httptools*.whl
python3 -c "import uvloop; print('uvloop', uvloop.__version__)" >> $OUT/summary.log 2>&1
BASE=$PYTHONPATH; PORT=8731; START=$(date +%s)
for run in 1 2; do for cfg in h11:4 ht:4 ht:2; do
  [ $(( $(date +%s) - START )) -gt ${LIMIT:-330} ] && { echo "out of time before $cfg run $run" >> $OUT/summary.log; break 2; }
  http=${cfg%:*}; ms=${cfg#*:}; tag=${http}_${ms}ms_run$run
  if [ $http = ht ]; then export PYTHONPATH=/tmp/ht:$BASE; else export PYTHONPATH=$BASE; fi
  python -c "import importlib.util as u; print('$tag httptools', u.find_spec('httptools') is not None)" >> $OUT/summary.log
  SPECDEC_STREAM_INTERVAL_MS=$ms timeout 200 python -m specdec serve /tmp/sm --device cuda --no-spec --port $PORT > /tmp/srv_$tag.log 2>&1 &
  SPID=$!; t0=$(date +%s)
  for i in $(seq 1 300); do kill -0 $SPID 2>/dev/null || break; curl -s -o /dev/null -w "%{http_code}" http://127.0.0.1:$PORT/health 2>/dev/null | grep -q 200 && break; sleep 0.5; done
  timeout 150 python benchmarks/bench_serve.py --url http://127.0.0.1:$PORT --plain-only --concurrency 64 256 --requests-per-level 1536 --max-tokens 128 --temperature 0.8 --prompts-file benchmarks/data/heldout_prompts.jsonl --warmup-requests 2 --out /tmp/serve_$tag.json > $OUT/bp_$tag.log 2>&1
  (echo "== $tag $(( $(date +%s) - t0 ))s $(date +%T)"; grep "c=" $OUT/bp_$tag.log) >> $OUT/summary.log
  kill $SPID; wait $SPID 2>/dev/null; sleep 1
done; done
cat $OUT/summary.log; date
