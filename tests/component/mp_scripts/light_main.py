"""Run a check script's ``__main__`` block while this import-light file stays the process's main module.

    python light_main.py SCRIPT_MODULE ARGS...      (the module is looked up next to this file)

Megatron's checkpoint writer starts a multiprocessing Manager with the spawn method, and a spawned
process re-imports the main module (as ``__mp_main__``). Run directly, a check script's top-level
imports of torch, Megatron and the package are paid again by every rank that saves (~6 CPU-seconds
each, four times in megatron_layouts.py); through this file the Manager imports nothing heavy.
The script runs in its own namespace (``__name__ == "__main__"``), so it must not pickle classes or
functions it defines (pickle would look them up in this module); the scripts run this way don't.
"""

import runpy
import sys

if __name__ == "__main__":
    sys.argv = sys.argv[1:]
    runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=False)
