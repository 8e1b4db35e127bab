"""The engine's own process: its loop (`engine_process`), the frames it exchanges with the HTTP
process (`wire`), the figures it reports (`snapshot`, `stats_log`). The HTTP side's handle is
`specdec.server.engine_client.EngineClient`; nothing here imports the server."""
