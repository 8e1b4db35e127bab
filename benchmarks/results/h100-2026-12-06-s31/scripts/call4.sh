source .carry/s/setup.sh > /dev/null
PORT=8733
python -m specdec serve $GG --device cuda --no-spec --port $PORT > $OUT/srv.log 2>&1 &
SPID=$!
for i in $(seq 1 120); do curl -s -o /dev/null -w "%{http_code}" http://127.0.0.1:$PORT/health 2>/dev/null | grep -q 200 && break; sleep 1; done
python benchmarks/bench_serve.py --url http://127.0.0.1:$PORT --plain-only --concurrency 64 --requests-per-level 768 --max-tokens 128 --temperature 0.8 --client-processes 4 --warmup-requests 2 --out /tmp/bp.json > /tmp/bp.log 2>&1 &
BPID=$!
sleep 6
EPID=$(pgrep -P $SPID | tail -1)
py-spy record -d 5 -r 300 -f raw --nonblocking -p $EPID -o /tmp/eng.txt > /dev/null 2>&1 &
py-spy record -d 5 -r 300 -f raw --nonblocking -p $SPID -o /tmp/http.txt > /dev/null 2>&1 &
wait $BPID; sleep 2
tail -2 /tmp/bp.log | head -1
kill $SPID; wait $SPID 2>/dev/null
python .carry/s/spysum.py /tmp/eng.txt > $OUT/spy_engine.txt 2>&1; python .carry/s/spysum.py /tmp/http.txt > $OUT/spy_http.txt 2>&1
head -40 $OUT/spy_engine.txt
cat > /tmp/gen.py <<'PY'
import time, sys, torch
sys.path.insert(0, "benchmarks")
from specdec import LLM, SamplingParams
from specdec.bench import DEFAULT_PROMPTS
import os
for c in (64, 256):
    llm = LLM(model=os.environ["GG"], device="cuda", max_num_seqs=c, speculative_config=None)
    llm.engine.warm_up(progress=False)
    n = max(c, 256)
    chats = [[{"role": "user", "content": DEFAULT_PROMPTS[i % len(DEFAULT_PROMPTS)]}] for i in range(n)]
    params = [SamplingParams(max_tokens=128, temperature=0.8, seed=i, ignore_eos=True) for i in range(n)]
    llm.chat(chats[:c], [SamplingParams(max_tokens=16, ignore_eos=True, seed=0)] * c, use_tqdm=False)
    t = time.perf_counter(); out = llm.chat(chats, params, use_tqdm=False); d = time.perf_counter() - t
    print(f"generate plain c={c}: {sum(len(o.outputs[0].token_ids) for o in out)/d:.0f} tok/s", flush=True)
    del llm; torch.cuda.empty_cache()
PY
timeout 150 python /tmp/gen.py 2>&1 | grep -v Warning | tail -5
