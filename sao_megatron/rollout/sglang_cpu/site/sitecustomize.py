"""Makes the real sglang 0.5.23 server run on a CPU machine; on PYTHONPATH of SGLang processes only.

Imported by Python at start-up in every process of a CPU SGLang server (the launcher puts this
directory first on PYTHONPATH; ``sao_megatron/rollout/sglang_cpu/__init__.py`` says why each piece
exists). It refuses any other sglang release: the patches below name lines of 0.5.23.
``SAO_SGLANG_CPU_DISABLE=name,...`` turns pieces off (tests show each one is needed).
"""

import importlib.abc
import importlib.metadata
import os
import sys

_WANT = "0.5.23"
_HERE = os.path.dirname(os.path.abspath(__file__))
_DISABLED = {p for p in os.environ.get("SAO_SGLANG_CPU_DISABLE", "").split(",") if p}


def _check_version():
    try:
        have = importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        have = None
    if have != _WANT:
        sys.stderr.write(
            f"sao_megatron sglang_cpu: this CPU support is written for sglang=={_WANT} exactly, but this "
            f"python ({sys.executable}) has sglang {have or 'not installed'}. Build the pinned env with "
            "`bash scripts/setup.sh --sglang` (or `make sglang-env`) and point rollout.sglang_python at "
            "the python it prints.\n")
        sys.stderr.flush()
        os._exit(2)  # SystemExit here would be a fatal error of site.py with a traceback


def _alloc_plain(dims, dtype, device, pin_memory, allocator, registration_granularity_bytes=None):
    import torch

    return torch.empty(dims, dtype=dtype, device="cpu")


def _patch_host_alloc(module):
    # sglang/srt/mem_cache/pool_host/common.py:453: ALLOC_MEMORY_FUNCS has no "cpu" entry, so the
    # routed-experts capture buffer (--enable-return-routed-experts; srt/state_capturer/base.py:67)
    # falls to alloc_with_host_register and cudaHostRegister (common.py:147), which fails without
    # CUDA. Host memory needs no pinning when there is no device to copy to.
    module.ALLOC_MEMORY_FUNCS["cpu"] = _alloc_plain


_POST_IMPORT = {"sglang.srt.mem_cache.pool_host.common": ("host_alloc", _patch_host_alloc)}


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, loader, patch):
        self._loader, self._patch = loader, patch

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        self._patch(module)


class _PostImportPatcher(importlib.abc.MetaPathFinder):
    """Runs a patch right after the named sglang module has executed (before anyone uses it)."""

    def find_spec(self, name, path, target=None):
        entry = _POST_IMPORT.get(name)
        if entry is None or entry[0] in _DISABLED:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _PatchingLoader(spec.loader, entry[1])
                return spec
        return None


_check_version()
if "sgl_kernel" not in _DISABLED:
    # sglang/kernels/ops/kvcache/cache_move.py:10 (and srt/mem_cache/allocation.py:46, ...) import
    # sgl_kernel at module level; its loader (sgl_kernel/load_utils.py:192) needs libcuda.so.1.
    sys.path.insert(0, os.path.join(_HERE, "stand_in"))
if "cpu_engine" not in _DISABLED:
    # sglang/srt/utils/common.py:221: is_cpu() reads SGLANG_USE_CPU_ENGINE; without it
    # srt/layers/rotary_embedding/base.py:138 imports vLLM's custom ops on a non-CUDA device.
    os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
sys.meta_path.insert(0, _PostImportPatcher())
