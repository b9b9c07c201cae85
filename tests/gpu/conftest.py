"""tests/gpu: the GPU checks (marked gpu, skipped without CUDA) and the CPU tests of their plumbing.

The Megatron scripts in mp_scripts/ run in subprocesses (tests/component/megatron_launch.py says
why); the slow obviously-correct references live in tests/unit/algo_reference.py.
"""

from __future__ import annotations

import pathlib
import sys

TESTS = pathlib.Path(__file__).resolve().parents[1]
for sub in ("unit", "component"):
    if str(TESTS / sub) not in sys.path:
        sys.path.insert(0, str(TESTS / sub))
