source .carry/s/setup.sh > /dev/null; date
cat > /tmp/gen.py <<'PY'
import time, sys, os, torch
from specdec import LLM, SamplingParams
from specdec.bench import DEFAULT_PROMPTS
for spec in (None, "default"):
  for c in (64, 256):
    kw = {} if spec else {"speculative_config": None}
    llm = LLM(model=os.environ["GG"], device="cuda", max_num_seqs=c, **kw)
    llm.engine.warm_up(progress=False)
    n = 256
    chats = [[{"role": "user", "content": DEFAULT_PROMPTS[i % len(DEFAULT_PROMPTS)]}] for i in range(n)]
    params = [SamplingParams(max_tokens=128, temperature=0.8, seed=i, ignore_eos=True) for i in range(n)]
    llm.chat(chats[:c], [SamplingParams(max_tokens=16, ignore_eos=True, seed=0)] * c, use_tqdm=False)
    t = time.perf_counter(); out = llm.chat(chats, params, use_tqdm=False); d = time.perf_counter() - t
    print(f"generate {'spec' if spec else 'plain'} c={c}: {sum(len(o.outputs[0].token_ids) for o in out)/d:.0f} tok/s", flush=True)
    del llm; torch.cuda.empty_cache()
PY
timeout 200 python /tmp/gen.py 2>&1 | grep -v Warning | tail -6
date
timeout 200 python -m pytest -q -p no:cacheprovider tests/parity/test_replay_gpu.py -k "builtin" 2>&1 | tail -4
date
