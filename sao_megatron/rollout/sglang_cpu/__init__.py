"""Running the real SGLang 0.5.23 server on a CPU machine (tests, CI, the tiny CPU job).

The PyPI wheel serves a bf16/fp32 MoE on CPU with SGLang's own torch fallbacks (torch-native
attention, pytorch sampling, the unquantized MoE path) once three things are in place. They live in
``site/`` and reach every SGLang process (the server and the scheduler/detokenizer processes it
spawns) through ``PYTHONPATH``; ``site/sitecustomize.py`` refuses any sglang release but
:data:`SGLANG_VERSION`:

- ``stand_in/sgl_kernel``: a stand-in for the CUDA kernel package, imported at module level on the
  CPU path; its functions raise if ever called.
- ``SGLANG_USE_CPU_ENGINE=1``, which SGLang's ``is_cpu()`` reads.
- a ``"cpu"`` host allocator for ``--enable-return-routed-experts``.

Each is tested to be needed (``tests/sglang/test_cpu_site.py``). Nothing here imports torch or
sglang: the main venv has no sglang, and the site directory only runs inside SGLang's own venv
(``scripts/setup.sh --sglang``). On GPUs none of it is used.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

SGLANG_VERSION = "0.5.23"
"""The one sglang release the site directory is written against."""

SITE_DIR = Path(__file__).resolve().parent / "site"
"""Put first on an SGLang process's PYTHONPATH to run it on CPU."""

PATCHES = ("sgl_kernel", "cpu_engine", "host_alloc")
"""Names for ``SAO_SGLANG_CPU_DISABLE`` (comma-separated): tests turn one off to show it is needed."""


def cpu_env(base: Mapping[str, str], *, disable: tuple[str, ...] = ()) -> dict[str, str]:
    """``base`` with the site directory first on PYTHONPATH (and ``disable``d patches named)."""
    unknown = set(disable) - set(PATCHES)
    if unknown:
        raise ValueError(f"unknown SGLang CPU patches {sorted(unknown)}; known: {list(PATCHES)}")
    env = dict(base)
    path = [str(SITE_DIR), *[p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]]
    env["PYTHONPATH"] = os.pathsep.join(path)
    env["SAO_SGLANG_CPU_DISABLE"] = ",".join(disable)
    return env
