# s36 call 2: LLM.chat plain on the same requests, profiled during its timed run (py-spy)
source .carry/s/setup.sh > $OUT/setup5.log 2>&1; date
[ -d /tmp/sm ] || python benchmarks/make_checkpoint.py smollm2-135m --out /tmp/sm --device cuda --tokenizer-json .carry/tok/tokenizer.json 2>&1 | tail -1
rm -f /tmp/gen_started
python .carry/s/gen.py /tmp/sm cuda 1536 plain > /tmp/gen.log 2>&1 &
GPID=$!
while [ ! -f /tmp/gen_started ]; do sleep 0.05; done
py-spy record -d 2 -r 250 -f raw --nonblocking -p $GPID -o /tmp/gen_spy.txt > /dev/null 2>&1
wait $GPID; tail -1 /tmp/gen.log | cut -c1-300
python .carry/s/spysum.py /tmp/gen_spy.txt > $OUT/spy_gen.txt 2>&1; sed -n '/== inclusive/,$p' $OUT/spy_gen.txt | head -60
date
