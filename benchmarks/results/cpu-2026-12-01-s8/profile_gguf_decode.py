import time, torch
torch.set_num_threads(2)
from specdec.engine.llm import LLM
from specdec.sampling import SamplingParams
llm = LLM(speculative_config=None)
p = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
ids = [[1, 2, 3, 4, 5, 6, 7, 8]]
llm.generate(ids, p, use_tqdm=False)
t=time.perf_counter(); llm.generate(ids, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True), use_tqdm=False); t1=time.perf_counter()-t
t=time.perf_counter(); llm.generate(ids, p, use_tqdm=False); t48=time.perf_counter()-t
print(f"TPOT {(t48-t1)/47*1e3:.2f} ms")
from torch.profiler import profile, ProfilerActivity
with profile(activities=[ProfilerActivity.CPU]) as prof:
    llm.generate(ids, p, use_tqdm=False)
ev = prof.key_averages()
tot = sum(e.self_cpu_time_total for e in ev)
print(f"events per token: {sum(e.count for e in ev)/48:.0f}; self CPU total per token {tot/48/1e3:.2f} ms")
for e in sorted(ev, key=lambda e: -e.self_cpu_time_total)[:12]:
    print(f"  {e.key[:50]:50s} {e.self_cpu_time_total/48/1e3:7.3f} ms/token  calls/token {e.count/48:6.1f}")
