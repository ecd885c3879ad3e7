"""The daemon: an asyncio HTTP server (OpenAI-compatible API, metrics, state events) over an engine process.

It never imports torch: it reaches the engine through `mleagle.engine.contract.protocol` over the engine channel (one Unix socket), and loads
the tokenizer the engine saved. Entry points: `mleagle.daemon.cli.serve_main` (`mleagle serve`) and
`mleagle.daemon.bench_serve.bench_serve_main` (`mleagle bench serve`).
"""
