"""The engine: `LLM` and `LLMEngine`, request state, scheduling, the step loop and its parts
(proposals, emission, output processing). KV block accounting and the model runner live in
`specdec.runner`, below the engine and the drafters."""
