"""Command-line entry points that run the engine in-process: generate, bench."""
