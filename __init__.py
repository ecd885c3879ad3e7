"""mleagle: LLM serving built around multi-layer EAGLE speculative decoding.

The repository root is this package. `mleagle.engine` holds models, KV pools, runners, the scheduler
and the speculative worker; `mleagle.daemon` the asyncio HTTP server; `mleagle.tui` the operator
terminal UI; `mleagle.configs` the bundled configurations. Importing this package imports nothing heavy.
"""

__version__ = "0.1.0"
