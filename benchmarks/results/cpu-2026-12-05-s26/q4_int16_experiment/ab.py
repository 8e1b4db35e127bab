import time, torch, statistics
from specdec import LLM, SamplingParams
from specdec.models.quant import QuantizedWeight
from specdec.models.quant_formats import GroupQuantized
from specdec.models.quant_q4 import q4_unpack
torch.set_num_threads(2)
def build(kind):
    llm = LLM(speculative_config=None)
    eng = llm.engine
    if kind == "int4":
        for layer in eng.model.model.layers:
            for blk, names in ((layer.self_attn, ("qkv_proj","o_proj")), (layer.mlp, ("gate_up_proj","down_proj"))):
                for n in names:
                    lin = getattr(blk, n); qw = lin.quantized
                    q, d, m = q4_unpack(qw._tensors["q4_packed"], qw._tensors["q4_scales"], qw.shape[1])
                    lin.quantized = QuantizedWeight(GroupQuantized(q.to(torch.int8), d, m, 32, (0, 15)), "cpu", layout="cpu_int4")
        eng.model.model._native = None
    return llm
llms = {k: build(k) for k in ("q4", "int4")}
import os
if os.environ.get("PYLOOP"):
    for l in llms.values(): l.engine.model.model._native = False
msgs=[[{"role":"user","content":"Write a Python function that returns the n-th Fibonacci number."}]]
p=SamplingParams(temperature=0, max_tokens=65, ignore_eos=True)
p1=SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
res={k:[] for k in llms}; pre={k:[] for k in llms}
for r in range(5):
    for k, llm in llms.items():
        t=time.perf_counter(); llm.chat(msgs, p1, use_tqdm=False); d1=time.perf_counter()-t
        t=time.perf_counter(); llm.chat(msgs, p, use_tqdm=False); dt=time.perf_counter()-t
        res[k].append((dt-d1)/64*1e3); pre[k].append(d1*1e3)
for k,v in res.items(): print(k, "TPOT ms median %.2f"%statistics.median(v), [round(x,2) for x in v], "first token ms %.1f"%statistics.median(pre[k]))
