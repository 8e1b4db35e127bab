# s39 call 2: GGUF part 2 of 3 (xz)
source .carry/s/setup.sh 2>&1 | tail -2
