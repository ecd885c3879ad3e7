"""`mleagle-tui`: a Textual terminal UI over the engine's state events (live, recorded and replayed).

It imports only the torch-free event schema (`mleagle.engine.contract.events`) and tracker
(`mleagle.engine.contract.event_bus`), so it installs with `pip install mleagle[tui]` and runs on a laptop.
`app` holds the App and the console entry `main`, `source` the live WebSocket and replay sources,
`model` the view model, and `panels/` one module per tab.
"""
