import torch, time
from specdec.models.quant_q4 import q4_pack, q4_linear
from specdec.models.quant import QuantizedWeight
from specdec.models.quant_formats import GroupQuantized
torch.set_num_threads(2)
torch.manual_seed(0)
shapes=[(960,576),(576,576),(3072,576),(576,1536)]
layers=[]
for L in range(30):
    for (N,K) in shapes:
        q = torch.randint(0, 16, (N, K), dtype=torch.int8)
        d = (torch.rand(N, K // 32) * 0.02).half().float(); m = (-torch.rand(N, K // 32) * 0.1).half().float()
        gq = GroupQuantized(q, d, m, 32, (0, 15))
        layers.append((K, q4_pack(gq), QuantizedWeight(gq, "cpu", layout="cpu_int4")))
xs={K:{M:torch.randn(M,K) for M in (1,2,3,4,8)} for K in (576,1536)}
def run_q4(M):
    for K,pk,qw in layers: q4_linear(xs[K][M],*pk)
def run_t(M):
    for K,pk,qw in layers: qw.matmul(xs[K][M])
for M in (1,2,3,4,8):
    a=[];b=[]
    for r in range(7):
        t=time.perf_counter(); run_q4(M); a.append(time.perf_counter()-t)
        t=time.perf_counter(); run_t(M); b.append(time.perf_counter()-t)
    a.sort();b.sort()
    print(f"M={M}: q4 {a[3]*1e3:.2f} ms  torch-int4 {b[3]*1e3:.2f} ms  ratio {a[3]/b[3]:.2f}")
