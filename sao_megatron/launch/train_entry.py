"""What torchrun runs on launched trainer nodes: ``sao-megatron train`` once the engines answer.

``python -m sao_megatron.launch.train_entry [--wait-for URL ...] [--timeout S] -- train --config ...``

Importing torch and Megatron takes about as long as an engine takes to load, so each rank
imports first and only then waits for ``/health`` of every engine (and the router): both
happen at once instead of one after the other. The trainer checks the engines exactly once
at start and fails fast, so it must not start before they are up.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from sao_megatron.launch.node import ENGINE_START_TIMEOUT_S
from sao_megatron.rollout.health import wait_healthy

log = logging.getLogger(__name__)
# Imported before waiting (best effort: a missing one is imported by the trainer as usual).
_PREIMPORT = ("torch", "torch.distributed", "megatron.core", "sao_megatron.training.run.trainer")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv:
        raise SystemExit("usage: python -m sao_megatron.launch.train_entry [--wait-for URL ...] -- train ...")
    split = argv.index("--")
    parser = argparse.ArgumentParser(prog="python -m sao_megatron.launch.train_entry")
    parser.add_argument("--wait-for", action="append", default=[], metavar="URL",
                        help="engine or router base URL that must answer /health first (repeatable)")
    parser.add_argument("--timeout", type=float, default=ENGINE_START_TIMEOUT_S,
                        help="seconds to wait for them (default %(default)s)")
    args = parser.parse_args(argv[:split])
    for name in _PREIMPORT:
        try:
            importlib.import_module(name)
        except ImportError as exc:
            log.debug("pre-import of %s skipped: %s", name, exc)
    if args.wait_for:
        wait_healthy(args.wait_for, timeout_s=args.timeout)
    from sao_megatron.cli import main as cli_main

    return cli_main(argv[split + 1:])


if __name__ == "__main__":
    sys.exit(main())
