"""`flowengine` command line: serve, generate, bench."""

from __future__ import annotations

import argparse
import importlib
import sys

from flowengine.version import __version__


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(
        prog="flowengine", description="FlowEngine: LLM inference and serving"
    )
    parser.add_argument("--version", action="version", version=f"flowengine {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("serve", help="OpenAI-compatible HTTP server", add_help=False)
    sub.add_parser("generate", help="print completions of prompts", add_help=False)
    bench = sub.add_parser("bench", help="benchmarks: throughput, serve, ring, pipeline")
    bench.add_argument("which", choices=["throughput", "serve", "ring", "pipeline"])
    if not argv or argv[0] not in ("serve", "generate", "bench"):
        # Also answers --version / --help (argparse exits 0 for them).
        parser.parse_args(argv)  # prints usage / errors
        return 2
    command, rest = argv[0], argv[1:]
    if command == "serve":
        from flowengine.entrypoints.openai.server import main as serve_main

        return serve_main(rest)
    if command == "generate":
        from flowengine.entrypoints.generate import main as generate_main

        return generate_main(rest)
    if not rest or rest[0].startswith("-"):
        parser.parse_args(argv)
        return 2
    which, rest = rest[0], rest[1:]
    if which not in ("throughput", "serve", "ring", "pipeline"):
        parser.parse_args(argv)
        return 2
    try:  # `bench serve` imports httpx, which only the 'bench' extra installs
        bench_main = importlib.import_module(f"flowengine.bench.{which}").main
    except ImportError as err:
        print(f"flowengine bench {which}: error: {err}; install the 'bench' extra: "
              "pip install 'flowengine[bench]'", file=sys.stderr)
        return 2
    return bench_main(rest) or 0


if __name__ == "__main__":
    raise SystemExit(main())
