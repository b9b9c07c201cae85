"""Several ``sao_megatron.cli.main`` calls in one process (the real dispatcher, its exit codes).

    python cli_calls.py '[["convert", ...], ...]'     prints "RCS [code, ...]"
"""

import json
import sys

if __name__ == "__main__":
    from sao_megatron.cli import main

    print("RCS", json.dumps([main(argv) for argv in json.loads(sys.argv[1])]), flush=True)
