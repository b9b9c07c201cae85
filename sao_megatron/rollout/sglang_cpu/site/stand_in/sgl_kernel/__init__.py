"""A stand-in for SGLang's CUDA kernel package (``sglang-kernel``) on a CPU machine.

sglang 0.5.23 imports ``sgl_kernel`` (and submodules such as ``sgl_kernel.kvcacheio``) at module
level on its CPU path, though a bf16/fp32 MoE on CPU never calls it: SGLang's torch fallbacks serve
everything. Every name resolves to an object that raises when called, so a kernel that IS reached
fails loudly with its name instead of computing nonsense.
"""

import importlib.abc
import importlib.machinery
import sys
import types


class KernelMissing(RuntimeError):
    """A CUDA kernel of sgl_kernel was called on the CPU stand-in."""


class _Missing:
    def __init__(self, name):
        self._name = name

    def __call__(self, *args, **kwargs):
        raise KernelMissing(f"{self._name} is a CUDA kernel of sgl_kernel; this CPU stand-in cannot run it")

    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Missing(f"{self._name}.{attr}")

    def __repr__(self):
        return f"<sgl_kernel stand-in {self._name}>"


def _module_getattr(prefix):
    def __getattr__(attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Missing(f"{prefix}.{attr}")
    return __getattr__


class _SubmoduleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """``sgl_kernel.<anything>`` is another stand-in module."""

    def find_spec(self, name, path, target=None):
        if name.startswith(__name__ + "."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__getattr__ = _module_getattr(spec.name)
        return module

    def exec_module(self, module):
        pass


__getattr__ = _module_getattr(__name__)
sys.meta_path.insert(0, _SubmoduleFinder())
