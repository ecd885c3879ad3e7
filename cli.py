"""The `mleagle` command: dispatches to the subcommand's own module, importing only what it needs.

`generate` and `bench` run the engine in-process (torch); `serve` starts the daemon, which itself
never imports torch; `bench serve` is the online load generator against a running server, and
`bench serve-matrix` starts servers of its own and runs it over configurations and concurrencies.
"""

from __future__ import annotations

import sys

USAGE = """usage: mleagle <command> [options]

commands:
  generate      offline generation with the engine (see mleagle generate --help)
  bench         offline throughput benchmark vs HF transformers (mleagle bench --help)
  bench serve   online load generator against a running server (mleagle bench serve --help)
  bench serve-matrix  starts servers for several configurations, runs bench serve at several
                concurrencies with repeats, optionally replays offline (mleagle bench serve-matrix --help)
  bench gpu     GPU benchmark through Engine.generate: graphs, eager, speculation, HF (mleagle bench gpu --help)
  bench prefix  prefix cache on against off: TTFT, prompt tokens computed, acceptance (mleagle bench prefix --help)
  bench structured  JSON-schema constraint against free decoding, with and without the draft (CPU)
  serve         start the OpenAI-compatible daemon (mleagle serve --help)
  engine-ranks  run this node's tensor-parallel ranks of a multi-node engine (mleagle engine-ranks --help)
  train-draft   make a draft from the target's own outputs: generate, train, eval, all (mleagle train-draft --help)
"""


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if args else 2
    cmd, rest = args[0], args[1:]
    if cmd == "generate":
        from mleagle.engine.entrypoints.generate import main as run
    elif cmd == "bench" and rest[:1] == ["gpu"]:
        from mleagle.engine.entrypoints.bench_gpu import main as run

        rest = rest[1:]
    elif cmd == "bench" and rest[:1] == ["prefix"]:
        from mleagle.engine.entrypoints.bench_prefix import main as run

        rest = rest[1:]
    elif cmd == "bench" and rest[:1] == ["structured"]:
        from mleagle.engine.entrypoints.bench_structured import main as run

        rest = rest[1:]
    elif cmd == "bench" and rest[:1] == ["serve-matrix"]:
        from mleagle.daemon.bench_matrix import bench_matrix_main as run

        rest = rest[1:]
    elif cmd == "bench" and rest[:1] == ["serve"]:
        from mleagle.daemon.bench_serve import bench_serve_main as run

        rest = rest[1:]
    elif cmd == "bench":
        from mleagle.engine.entrypoints.bench import main as run
    elif cmd == "serve":
        from mleagle.daemon.cli import serve_main as run
    elif cmd == "engine-ranks":
        from mleagle.engine.service.ranks import launcher_main as run
    elif cmd == "train-draft":
        from mleagle.engine.entrypoints.train_draft import main as run
    else:
        print(f"mleagle: unknown command {cmd!r}\n\n{USAGE}", file=sys.stderr)
        return 2
    return int(run(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
