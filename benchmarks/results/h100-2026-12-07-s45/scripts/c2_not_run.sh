# s45 call B: GGUF part 2 only
source .carry/u/setup.sh > $OUT/setup2.log 2>&1; ls -la /tmp/gg | tee -a $S
