"""KV memory: the slot allocator, per-runner KV pools and request-to-token maps."""
