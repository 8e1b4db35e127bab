# s36 call 1: random bf16 weights of the built-in model's shape; --no-spec server at c = 64 traced and profiled, then LLM.chat plain on the same requests, traced
source .carry/s/setup.sh > $OUT/setup4.log 2>&1; date
python benchmarks/make_checkpoint.py smollm2-135m --out /tmp/sm --device cuda --tokenizer-json .carry/tok/tokenizer.json 2>&1 | tail -1
GG=/tmp/sm
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .carry/w/opentelemetry*.whl 2>&1 | tail -1
export PYTHONPATH=$PWD/.carry/s:$PYTHONPATH
PORT=8731
SPECDEC_TRACE=/tmp/tr_srv python -m specdec serve $GG --device cuda --no-spec --port $PORT > $OUT/srv.log 2>&1 &
SPID=$!
for i in $(seq 1 150); do kill -0 $SPID 2>/dev/null || break; curl -s -o /dev/null -w "%{http_code}" http://127.0.0.1:$PORT/health 2>/dev/null | grep -q 200 && break; sleep 1; done
echo ready $i
curl -s http://127.0.0.1:$PORT/metrics | grep -E "^specdec:(num_)" > /tmp/m0.txt
python benchmarks/bench_serve.py --url http://127.0.0.1:$PORT --plain-only --concurrency 64 --requests-per-level 768 --max-tokens 128 --temperature 0.8 --prompts-file benchmarks/data/heldout_prompts.jsonl --warmup-requests 2 --out $OUT/serve_plain.json > /tmp/bp.log 2>&1 &
BPID=$!
sleep 5
EPID=$(pgrep -P $SPID | tail -1)
echo srv $SPID eng $EPID; pgrep -P $SPID -a | cut -c1-120
py-spy record -d 4 -r 250 -f raw --nonblocking -p $EPID -o /tmp/eng.txt > /dev/null 2>&1 &
py-spy record -d 4 -r 250 -f raw --nonblocking -p $SPID -o /tmp/http.txt > /dev/null 2>&1 &
sleep 1; top -b -n 1 -d 1 | head -20 > $OUT/top.txt
wait $BPID; sleep 1
tail -3 /tmp/bp.log
curl -s http://127.0.0.1:$PORT/metrics | grep -E "^specdec:(num_)" > /tmp/m1.txt
paste /tmp/m0.txt /tmp/m1.txt | awk '{print $1, $4-$2}' | tee $OUT/counters_srv.txt
kill $SPID; wait $SPID 2>/dev/null; sleep 1
python .carry/s/spysum.py /tmp/eng.txt > $OUT/spy_engine.txt 2>&1; head -45 $OUT/spy_engine.txt
python .carry/s/spysum.py /tmp/http.txt > $OUT/spy_http.txt 2>&1; head -25 $OUT/spy_http.txt
cp /tmp/tr_srv.* $OUT/ 2>/dev/null; python .carry/s/trace_sum.py /tmp/tr_srv.* | tee $OUT/trace_srv.log
[ -n "$GEN" ] && SPECDEC_TRACE=/tmp/tr_gen python .carry/s/gen.py $GG cuda 768 plain 2>&1 | tail -1 | cut -c1-400 | tee $OUT/gen_plain.json
[ -n "$GEN" ] && python .carry/s/trace_sum.py /tmp/tr_gen.* | tee $OUT/trace_gen.log; cp /tmp/tr_gen.* $OUT/
date
