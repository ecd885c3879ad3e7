"""Multi-layer EAGLE (chain MTP): the draft stack, its checkpoints, acceptance and the worker."""
