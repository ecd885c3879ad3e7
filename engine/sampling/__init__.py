"""Sampling: penalties, temperature and top-k/top-p/min-p filters, seeded draws and logprobs."""
