# usage: profile_serve.sh MODE(nospec|spec) CONC NREQ TAG ; one server, the level driven by 1 then auto client processes, py-spy on each process mid-run
MODE=$1; C=$2; N=$3; TAG=$4; PORT=$((8100 + RANDOM % 500))
EXTRA=""; PO=""
if [ "$MODE" = nospec ]; then EXTRA="--no-spec"; PO="--plain-only"; fi
python -m specdec serve $GG --device cuda $EXTRA --port $PORT > $OUT/srv_$TAG.log 2>&1 &
SPID=$!
for i in $(seq 1 240); do curl -s -o /dev/null -w "%{http_code}" http://127.0.0.1:$PORT/health 2>/dev/null | grep -q 200 && break; sleep 1; done
echo "ready after $i s"
for CP in 1 0; do
  python benchmarks/bench_serve.py --url http://127.0.0.1:$PORT $PO --concurrency $C --requests-per-level $N --max-tokens 128 --temperature 0.8 --client-processes $CP --warmup-requests 2 --out $OUT/b_${TAG}_cp$CP.json > $OUT/b_${TAG}_cp$CP.log 2>&1 &
  BPID=$!
  sleep 5
  KIDS=$(pgrep -P $SPID | tr '\n' ' ')
  BKIDS=$(pgrep -P $BPID | tr '\n' ' ')
  echo "cp=$CP server $SPID children $KIDS bench $BPID children $BKIDS"
  top -b -n 2 -d 2 -p $(echo $SPID $KIDS $BPID $BKIDS | tr ' ' ',') | tail -12 > $OUT/top_${TAG}_cp$CP.txt &
  for p in $SPID $KIDS $BPID $BKIDS; do
    timeout 20 py-spy record -d 4 -r 250 -f raw --nonblocking -p $p -o $OUT/spy_${TAG}_cp${CP}_$p.txt > $OUT/spy_${TAG}_cp${CP}_$p.log 2>&1 &
  done
  wait $BPID
  sleep 5
  tail -3 $OUT/b_${TAG}_cp$CP.log
  cat $OUT/top_${TAG}_cp$CP.txt
done
curl -s http://127.0.0.1:$PORT/metrics | grep -E "^specdec:(num_|stream_outputs_coalesced)" > $OUT/metrics_$TAG.txt
kill $SPID; wait $SPID 2>/dev/null
