# s46 call C (GGUF part 3: joined): the server at c = 1 / 16 / 64 against --no-spec (prompt graphs 2079967, head fc473b4, per-request acceptance e1c6468)
source .carry/u/setup.sh > $OUT/setup3.log 2>&1; tail -2 $OUT/setup3.log | tee -a $S
b Z16 230 --requests-per-level 768 --concurrency 16 64
b O_c1 150 --requests-per-level 48 --concurrency 1
