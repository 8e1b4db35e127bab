# s37 call 3: profile of the --no-spec server at c = 64 with the split step and outputs every 4 ms (py-spy of the engine and HTTP processes), counters
source .carry/s/setup.sh > /dev/null 2>&1
[ -d /tmp/sm ] || python benchmarks/make_checkpoint.py smollm2-135m --out /tmp/sm --device cuda --tokenizer-json .carry/tok/tokenizer.json 2>&1 | tail -1
python3 -c "import opentelemetry" 2>/dev/null || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .carry/w/opentelemetry*.whl
PORT=8731
python -m specdec serve /tmp/sm --device cuda --no-spec --port $PORT > $OUT/srv.log 2>&1 &
SPID=$!
for i in $(seq 1 300); do kill -0 $SPID 2>/dev/null || break; curl -s -o /dev/null -w "%{http_code}" http://127.0.0.1:$PORT/health 2>/dev/null | grep -q 200 && break; sleep 0.5; done
python benchmarks/bench_serve.py --url http://127.0.0.1:$PORT --plain-only --concurrency 64 --requests-per-level 1536 --max-tokens 128 --temperature 0.8 --prompts-file benchmarks/data/heldout_prompts.jsonl --warmup-requests 2 --out /tmp/p.json > $OUT/bp.log 2>&1 &
BPID=$!
sleep 4
EPID=$(pgrep -P $SPID | tail -1)
py-spy record -d 3 -r 250 -f raw --nonblocking -p $EPID -o /tmp/eng.txt > /dev/null 2>&1 &
py-spy record -d 3 -r 250 -f raw --nonblocking -p $SPID -o /tmp/http.txt > /dev/null 2>&1 &
sleep 1; top -b -n 1 -d 1 | head -14 > $OUT/top.txt
wait $BPID
kill $SPID; wait $SPID 2>/dev/null
grep "c=" $OUT/bp.log
python .carry/s/spysum.py /tmp/eng.txt > $OUT/spy_engine.txt 2>&1; head -60 $OUT/spy_engine.txt
python .carry/s/spysum.py /tmp/http.txt > $OUT/spy_http.txt 2>&1; head -40 $OUT/spy_http.txt
cat $OUT/top.txt
