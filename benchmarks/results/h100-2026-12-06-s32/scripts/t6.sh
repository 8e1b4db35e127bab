# A/B: the code before this session (old, /tmp/osrc) against the working tree (new); the
# built-in model, the same bench_serve levels, one server pair per version
source .carry/s/setup.sh > /dev/null; ls -la $GG || exit 1
if [ -d .carry/o/src ] && [ ! -d /tmp/osrc ]; then
  cp -r .carry/o/src /tmp/osrc
  cp src/specdec/drafters/default/smollm2-135m-instruct-eagle/model.safetensors /tmp/osrc/specdec/drafters/default/smollm2-135m-instruct-eagle/
fi
NEWPP=$PYTHONPATH; OLDPP=/tmp/site:/tmp/osrc:$PWD/tests:$PWD/benchmarks
for V in ${VERSIONS:-old new}; do
  if [ $V = old ]; then export PYTHONPATH=$OLDPP; else export PYTHONPATH=$NEWPP; fi
  python -c "import specdec, sys; print('$V', specdec.__file__)"
  date
  python benchmarks/bench_serve.py --serve $GG --device cuda --max-tokens 128 --temperature 0.8 --no-spec-server ${LOAD:---concurrency 16 64 256} --requests-per-level ${NREQ:-1024} --out-dir /tmp/o/ab${TAG}_$V > $OUT/ab${TAG}_$V.log 2>&1
  cp /tmp/o/ab${TAG}_$V/serve.json $OUT/ab${TAG}_$V.json
  grep -v "^$" /tmp/o/ab${TAG}_$V/serve.md | tail -n +5
done
export PYTHONPATH=$NEWPP
python - <<'PY'
import json, glob
for f in sorted(glob.glob("/tmp/o/ab*/serve.json")):
    m = json.load(open(f))["meta"]
    for k, v in m["engine_counters_by_level"].items():
        if k.startswith("spec"):
            print(f.split("/")[3], k, {a.replace("specdec:", "").replace("_total", ""): b for a, b in v.items() if "coalesced" not in a})
PY
date
