"""The engine: models, KV pools, batches, attention backends, runners, scheduler, speculative worker.

Importing `mleagle.engine` itself stays light (no torch): the torch-free modules here
(`config`, `sampling_params`, `outputs`, `events`, `protocol`, `detokenizer`) are shared with the
daemon and the TUI, and everything heavy is imported from its own module (`mleagle.engine.engine`).
"""
