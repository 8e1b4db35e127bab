"""The engine: request state, KV block accounting, scheduling, model runner and step loop."""
