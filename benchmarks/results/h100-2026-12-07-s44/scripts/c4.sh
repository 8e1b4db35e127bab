# s44 call 4: the server without rules at c = 16 / 64 with the LLM.generate ceiling; c = 1
source .carry/u/setup.sh > $OUT/setup4.log 2>&1
b Z_norules 330 --requests-per-level 768 --concurrency 16 64 --generate
b O_c1 200 --requests-per-level 48 --concurrency 1
