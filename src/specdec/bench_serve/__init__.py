"""The serving benchmark (`specdec bench --serve`, `benchmarks/bench_serve.py`): drives
`specdec serve` at several loads, speculation on vs off (JSON, markdown and a plot).

With `--serve MODEL` (no MODEL: the built-in one) it starts `specdec serve MODEL` itself on a
free loopback port
(engine flags: --device, --dtype, --speculative-config, and any --serve-arg), waits for /health,
warms it up, runs the levels, and stops it; its log goes to OUT_DIR/server.log. Without it,
`--url` names a server that is already running.

Each level sends `--requests-per-level` (at least the concurrency) streaming chat requests with
ignore_eos and fixed seeds (greedy unless --temperature): with `--concurrency C` in flight at
once, or with `--request-rate R` arriving as a Poisson process of R requests/s (seeded by
`--seed`; at most `--max-concurrency` in flight). It measures requests/s, output tokens/s, and
TTFT, TPOT and ITL (the gaps between streamed chunks) percentiles; "spec" requests ask
`speculative: {"enabled": true}` (the server's --speculative-config), "plain" ones
`{"enabled": false}`, on the same server. The prompts: the built-in chats, or `--prompts-file`
(a .jsonl of {"prompt": ...}: benchmarks/data/heldout_prompts.jsonl, 16 short held-out chats, or
benchmarks/data/long_prompts.jsonl, 32 prompts of about 1,300 tokens from `make_long_prompts.py`).

With `--generate` (and `--serve`), after the server has stopped the same requests run through
`LLM.chat` in this process, a closed batch per concurrency level (max_num_seqs = the
concurrency, at most the server's), spec and plain: the engine's ceiling, beside the server's
figures.

With `--rules mixed` the requests ask in turn for log-probabilities, penalties or a JSON schema
(`bench_serve.rules`; TPOT p50 per rule in the report): run it beside `--rules none` (the default)
to see what the rules cost with and without speculation.

    python benchmarks/make_checkpoint.py llama-3.2-1b --out /tmp/llama-3.2-1b --device cuda
    specdec bench --serve --concurrency 1 8 --no-spec-server --generate  # the built-in model
    python benchmarks/bench_serve.py --serve /tmp/llama-3.2-1b --device cuda --dtype bfloat16 \\
        --requests-per-level 8 --max-tokens 128 --out-dir bench-results/serve-h200
    # against a running server:
    python benchmarks/bench_serve.py --url http://127.0.0.1:8000 --out-dir bench-results/serve-cpu
"""

from specdec.bench_serve.run import main

__all__ = ["main"]
