"""The torch-free contract between the engine, the daemon and the TUI.

Everything here imports pydantic, tokenizers, jinja2 and (in the event bus's ZMQ classes) pyzmq, never
torch or the engine's internals: the daemon and `mleagle-tui` import only this package from the engine
(a test proves it), so the TUI installs on a laptop without torch and the daemon starts in well under a
second. `config` (model, engine and server settings), `sampling_params`, `outputs` (what a request
yields), `protocol` (daemon-engine messages), `channel` (their framing on one Unix socket), `events` (the state-event schema), `event_bus` (the
bounded bus, the state tracker and the ZMQ transport), `tokenizer`, `detokenizer`, `cli_flags` and
`gc_watch` (the collector's freeze and pause timing both serving processes use).
"""
