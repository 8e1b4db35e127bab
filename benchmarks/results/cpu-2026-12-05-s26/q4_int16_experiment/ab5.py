import time, torch, statistics, collections
exec(open('/tmp/q4/ab.py').read().split("msgs=")[0])
from specdec.models.cpu_extension import load_extension
ext = load_extension()
from specdec.models import decode_cpu_native as dcn
acc = collections.defaultdict(list); lin = collections.defaultdict(list)
current = [None]
orig = dcn.run_layers
def timed(*a, **k):
    ext.lin_reset(); t=time.perf_counter(); r=orig(*a, **k); acc[current[0]].append(time.perf_counter()-t); lin[current[0]].append(ext.lin_seconds()); return r
dcn.run_layers = timed
msgs=[[{"role":"user","content":"Write a Python function that returns the n-th Fibonacci number."}]]
p=SamplingParams(temperature=0, max_tokens=65, ignore_eos=True)
for r in range(4):
    for k, llm in llms.items():
        current[0]=k; llm.chat(msgs, p, use_tqdm=False)
for k,v in acc.items():
    print(k, "layers call median %.3f ms, linears %.3f ms"%(statistics.median(v)*1e3, statistics.median(lin[k])*1e3))
