source .carry/s/setup.sh > /dev/null; date
PORT=8733
python -m specdec serve $GG --device cuda --port $PORT > $OUT/srv.log 2>&1 &
SPID=$!
for i in $(seq 1 120); do curl -s -o /dev/null -w "%{http_code}" http://127.0.0.1:$PORT/health 2>/dev/null | grep -q 200 && break; sleep 1; done
echo ready $i
curl -s http://127.0.0.1:$PORT/metrics | grep -E "^specdec:(num_|spec_k)" > /tmp/m0.txt
python benchmarks/bench_serve.py --url http://127.0.0.1:$PORT --spec-only --concurrency 256 --requests-per-level 1536 --max-tokens 128 --temperature 0.8 --client-processes 4 --warmup-requests 2 --out /tmp/bp.json > /tmp/bp.log 2>&1 &
BPID=$!
sleep 10
EPID=$(pgrep -P $SPID | tail -1)
py-spy record -d 5 -r 300 -f raw --nonblocking -p $EPID -o /tmp/eng.txt > /dev/null 2>&1 &
wait $BPID; sleep 2
tail -4 /tmp/bp.log
curl -s http://127.0.0.1:$PORT/metrics | grep -E "^specdec:(num_|spec_k)" > /tmp/m1.txt
paste /tmp/m0.txt /tmp/m1.txt | awk '{print $1, $4-$2}'
kill $SPID; wait $SPID 2>/dev/null
python .carry/s/spysum.py /tmp/eng.txt > $OUT/spy_spec_engine.txt 2>&1; head -60 $OUT/spy_spec_engine.txt
date
timeout 200 python -m pytest -q -p no:cacheprovider tests/parity/test_replay_gpu.py -k "builtin" 2>&1 | tail -3
date
