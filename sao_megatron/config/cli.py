"""`sao-megatron config show|check --config X.yaml [--set k=v]`."""

from __future__ import annotations

import argparse
import sys

import yaml


def add_config_args(parser: argparse.ArgumentParser) -> None:
    """The shared `--config X.yaml [--set a.b=c ...]` arguments of every verb."""
    parser.add_argument("--config", required=True, help="experiment or model YAML")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config value, e.g. --set scheduler.max_staleness=2 (repeatable)")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("config", help="print the resolved config or check it")
    p.add_argument("action", choices=["show", "check"])
    add_config_args(p)
    p.add_argument("--world-size", type=int, default=None, help="also check divisibility for this many ranks")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from sao_megatron.config import load_config, to_dict

    cfg = load_config(args.config, args.overrides, world_size=args.world_size)
    if args.action == "show":
        sys.stdout.write(yaml.safe_dump(to_dict(cfg), sort_keys=False))
    else:
        sys.stdout.write(f"{args.config}: OK\n")
    return 0
