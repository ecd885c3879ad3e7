"""Model building blocks, written tensor-parallel (world size 1 on the CPU path)."""
