# s45 call C: GGUF joined; the server without rules at c = 64 (prompt graphs 2079967, head fc473b4, per-request acceptance e1c6468)
source .carry/u/setup.sh > $OUT/setup3.log 2>&1; tail -2 $OUT/setup3.log | tee -a $S
b Z64 400 --requests-per-level 768 --concurrency 64
