# s36 call 3: --no-spec server at c = 64 and 256: before (outputs every step, arrivals join at once), outputs every 4 ms, and outputs every 4 ms with arrivals gathered (the new default), alternating; then LLM.chat plain again
source .carry/s/setup.sh > $OUT/setup6.log 2>&1; date
[ -d /tmp/sm ] || python benchmarks/make_checkpoint.py smollm2-135m --out /tmp/sm --device cuda --tokenizer-json .carry/tok/tokenizer.json 2>&1 | tail -1
python3 -c "import opentelemetry" 2>/dev/null || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .carry/w/opentelemetry*.whl
PORT=8731
for run in 1 2; do for cfg in 0:0 4:0 4:1; do
ms=${cfg%:*}; ga=${cfg#*:}
SPECDEC_GATHER_PLAIN_ARRIVALS=$ga SPECDEC_STREAM_INTERVAL_MS=$ms python -m specdec serve /tmp/sm --device cuda --no-spec --port $PORT > $OUT/srv_${ms}_${ga}_$run.log 2>&1 &
SPID=$!
for i in $(seq 1 150); do kill -0 $SPID 2>/dev/null || break; curl -s -o /dev/null -w "%{http_code}" http://127.0.0.1:$PORT/health 2>/dev/null | grep -q 200 && break; sleep 1; done
curl -s http://127.0.0.1:$PORT/metrics | grep -E "^specdec:num_overlapped" > /tmp/m0.txt
python benchmarks/bench_serve.py --url http://127.0.0.1:$PORT --plain-only --concurrency 64 256 --requests-per-level 768 --max-tokens 128 --temperature 0.8 --prompts-file benchmarks/data/heldout_prompts.jsonl --warmup-requests 2 --out $OUT/serve_${ms}ms_gather${ga}_run$run.json > /tmp/bp.log 2>&1
echo "interval ${ms} ms gather $ga run $run"; grep "c=" /tmp/bp.log
curl -s http://127.0.0.1:$PORT/metrics | grep -E "^specdec:num_overlapped" > /tmp/m1.txt
paste /tmp/m0.txt /tmp/m1.txt | awk '{print $1, $4-$2}'
kill $SPID; wait $SPID 2>/dev/null; sleep 1
done; done
python .carry/s/gen.py /tmp/sm cuda 768 plain 2>&1 | tail -1 | cut -c1-120

cd $OUT && tar czf s36_call3.tgz --remove-files serve_* srv_* setup6.log; ls; date
