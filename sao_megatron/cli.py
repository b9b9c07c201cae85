"""`sao-megatron <verb> ...` entry point.

Each verb lives in its own module exposing ``add_parser(subparsers)`` which
registers the sub-command and sets ``func`` (called with the parsed args,
returning an exit code). Modules are imported only when their verb is used
(torch + megatron imports cost ~10 s), except to build ``--help``.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

# verb -> module with add_parser(subparsers). One line per verb.
_VERBS: dict[str, str] = {
    "config": "sao_megatron.config.cli",
    "plan": "sao_megatron.launch.planner_cli",
    "models": "sao_megatron.training.verbs.smoke_cli",
    "report": "sao_megatron.training.verbs.report",
    "train": "sao_megatron.training.verbs.cli",
    "sft": "sao_megatron.training.verbs.cli",
    "parity": "sao_megatron.training.verbs.parity",
    "serve-local": "sao_megatron.rollout.engine.cli",
    "convert": "checkpoints_tools.cli",
    "launch": "sao_megatron.launch.cli",
    "eval": "sao_megatron.training.verbs.eval_cli",
    "study": "sao_megatron.study.cli",
    "node": "sao_megatron.launch.node",
}


def build_parser(verbs: list[str] | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sao-megatron",
        description="Single-rollout Asynchronous Optimization for MoE LLMs on Megatron-core + SGLang.")
    parser.add_argument("--log-level", default="INFO", help="Python logging level (default INFO)")
    sub = parser.add_subparsers(dest="verb", metavar="VERB", required=True)
    # A module may register several verbs (train + sft): import each module once.
    for module in dict.fromkeys(_VERBS[v] for v in (verbs or list(_VERBS))):
        importlib.import_module(module).add_parser(sub)
    return parser


# Known, expected start-up noise of megatron-core and torch on machines without Transformer Engine,
# apex or CUDA (one screen per run otherwise). What was chosen instead is logged in one line by
# training.run.components ("models: ... specs ..., ... optimizer ...").
_KNOWN_WARNINGS = (r"Transformer Engine and Apex are not installed", r"Apex is not installed",
                   r"full scope is deprecated", r"No CUDA runtime is found", r"MimoModelConfig is experimental",
                   r"The \.grad attribute of a Tensor that is not a leaf",
                   r".*(reduce_scatter_tensor|all_gather_into_tensor)` is deprecated")
_KNOWN_LOG_LINES = ("IS DEPRECATED", "full_param_layout not provided", "No CUDA runtime is found",
                    "MCore's async save is deprecated")


class _KnownNoise(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not any(text in record.getMessage() for text in _KNOWN_LOG_LINES)


def quiet_known_noise() -> None:
    """Drop the expected warnings above; megatron-core's INFO chatter (DDP bucket dumps, FSDP
    detection) goes below WARNING. Everything else still shows."""
    import warnings

    for pattern in _KNOWN_WARNINGS:
        warnings.filterwarnings("ignore", message=pattern)
    logging.getLogger("megatron").setLevel(logging.WARNING)
    for handler in logging.getLogger().handlers:
        handler.addFilter(_KnownNoise())


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    import warnings

    for pattern in _KNOWN_WARNINGS:  # before any verb module imports megatron
        warnings.filterwarnings("ignore", message=pattern)
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)  # "No CUDA runtime is found"
    # Import only the module of the requested verb (fast start, isolated failures).
    verb = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser([verb] if verb in _VERBS else None)
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per HTTP request otherwise
    quiet_known_noise()
    from sao_megatron.config import ConfigError
    from sao_megatron.errors import SaoError

    try:
        return int(args.func(args) or 0)
    except ConfigError as exc:
        print(f"sao-megatron {args.verb}: config error: {exc}", file=sys.stderr)
        return 2
    except (ValueError, SaoError) as exc:
        logging.getLogger("sao_megatron").debug("traceback", exc_info=True)
        print(f"sao-megatron {args.verb}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
