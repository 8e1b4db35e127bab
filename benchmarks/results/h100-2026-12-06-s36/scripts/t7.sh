# s36 call 3 (budget-limited): --no-spec server at c = 64, the new defaults (outputs every 4 ms with 16+ streams, arrivals gathered) against before (SPECDEC_STREAM_INTERVAL_MS=0 SPECDEC_GATHER_PLAIN_ARRIVALS=0), alternating until the time runs out
source .carry/s/setup.sh > $OUT/setup7.log 2>&1; date
[ -d /tmp/sm ] || python benchmarks/make_checkpoint.py smollm2-135m --out /tmp/sm --device cuda --tokenizer-json .carry/tok/tokenizer.json 2>&1 | tail -1
python3 -c "import opentelemetry" 2>/dev/null || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .carry/w/opentelemetry*.whl
PORT=8731
for run in 1 2 3; do for cfg in 4:1 0:0; do
ms=${cfg%:*}; ga=${cfg#*:}
SPECDEC_GATHER_PLAIN_ARRIVALS=$ga SPECDEC_STREAM_INTERVAL_MS=$ms python -m specdec serve /tmp/sm --device cuda --no-spec --port $PORT > /tmp/srv.log 2>&1 &
SPID=$!
for i in $(seq 1 150); do kill -0 $SPID 2>/dev/null || break; curl -s -o /dev/null -w "%{http_code}" http://127.0.0.1:$PORT/health 2>/dev/null | grep -q 200 && break; sleep 0.5; done
curl -s http://127.0.0.1:$PORT/metrics | grep -E "^specdec:num_overlapped" > /tmp/m0.txt
python benchmarks/bench_serve.py --url http://127.0.0.1:$PORT --plain-only --concurrency 64 --requests-per-level 768 --max-tokens 128 --temperature 0.8 --prompts-file benchmarks/data/heldout_prompts.jsonl --warmup-requests 2 --out /tmp/s.json > /tmp/bp.log 2>&1
curl -s http://127.0.0.1:$PORT/metrics | grep -E "^specdec:num_overlapped" > /tmp/m1.txt
(echo "interval ${ms} ms gather $ga run $run $(date +%T)"; grep "c=" /tmp/bp.log; paste /tmp/m0.txt /tmp/m1.txt | awk '{print $1, $4-$2}') >> $OUT/summary.log
kill $SPID; wait $SPID 2>/dev/null
done; done
cat $OUT/summary.log
