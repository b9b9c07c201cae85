"""Run megatron-core on machines without a GPU: every CPU shim lives here.

megatron-core assumes CUDA in a handful of places (device placement, RNG
tracker, streams/events, MoE token dispatch, gloo-incompatible collectives).
``apply_cpu_shims()`` patches exactly those, only when ``torch.cuda.is_available()``
is false, only for the megatron-core versions they were verified against, and
at most once per process. On a GPU machine it does nothing.

Each shim is a named function below. Its docstring says what breaks without
it and which test catches the regression (see
tests/component/test_megatron_cpu_shims.py); ``apply_cpu_shims(skip=...)``
exists only so those tests can prove every shim is still needed.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Collection

import torch
from torch.overrides import TorchFunctionMode

logger = logging.getLogger(__name__)

SUPPORTED_MEGATRON_VERSIONS = ("0.19.2",)
"""megatron-core versions whose CUDA-only spots were audited for the shims below."""

_MARK = "_sao_cpu_shim"
_SKIPPED: set[str] = set()
"""Shims ``apply_cpu_shims(skip=...)`` left out (the necessity tests): ``apply_optimizer_shims`` honours it."""


class MegatronVersionError(RuntimeError):
    """The installed megatron-core was not audited for the CPU shims."""


def megatron_version() -> str:
    from megatron.core import package_info

    return package_info.__version__


def check_megatron_version() -> None:
    """Raise MegatronVersionError naming the installed version and the fix."""
    version = megatron_version()
    if version not in SUPPORTED_MEGATRON_VERSIONS:
        raise MegatronVersionError(
            f"megatron-core {version} is installed, but the CPU shims in {__name__} were verified "
            f"against {', '.join(SUPPORTED_MEGATRON_VERSIONS)}. Fix: install the pinned version "
            f"(`pip install megatron-core=={SUPPORTED_MEGATRON_VERSIONS[-1]}`, or rerun scripts/setup.sh), "
            f"or run on a GPU machine (no shims needed), or re-audit the shims for {version}: run "
            f"tests/component/test_megatron_cpu_shims.py and add it to SUPPORTED_MEGATRON_VERSIONS.")


def shims_applied() -> bool:
    """True once apply_cpu_shims() has patched this process."""
    return bool(getattr(torch.cuda, _MARK, False))


def apply_cpu_shims(*, skip: Collection[str] = (), force: bool = False) -> None:
    """Patch megatron-core/torch.cuda for CPU execution (no-op with a GPU unless ``force``: a run
    told ``resources.device=cpu`` on a GPU node; idempotent).

    ``skip`` names shims to leave out; only the necessity tests use it.
    """
    unknown = set(skip) - set(SHIMS)
    if unknown:  # a wrong name is an error whether or not this process is patched already
        raise ValueError(f"unknown CPU shim(s) {sorted(unknown)}; known: {sorted(SHIMS)}")
    if (torch.cuda.is_available() and not force) or shims_applied():
        return
    check_megatron_version()
    _SKIPPED.update(skip)
    for name, shim in SHIMS.items():
        if name not in skip:
            shim()
    setattr(torch.cuda, _MARK, True)  # the patched module itself records that it was patched
    logger.info("megatron-core %s: CPU shims applied (%s)", megatron_version(),
                ", ".join(n for n in SHIMS if n not in skip))


# --------------------------------------------------------------------------- torch.cuda stubs
class _CpuStream:
    """Stand-in for torch.cuda.Stream: CPU work is synchronous, so every method is a no-op."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def wait_stream(self, stream) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def record_event(self, event=None):
        return event if event is not None else _CpuEvent()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class _CpuEvent:
    """Stand-in for torch.cuda.Event (record/wait/synchronize are no-ops on CPU)."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def record(self, stream=None) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, other) -> float:
        return 0.0


_CPU_STREAM = _CpuStream()


def _shim_torch_cuda_stubs() -> None:
    """torch.cuda.current_device/streams/events/synchronize without a driver.

    Without it: building an MoE layer fails in MoEAlltoAllTokenDispatcher.__init__
    (``torch.cuda.Stream()``), and GlobalMemoryBuffer, rotary embedding, the router,
    TP/PP mappings, p2p communication, DDP grad buffers and the checkpoint saver all
    call ``torch.cuda.current_device()`` ("Found no NVIDIA driver").
    Device index 0 is returned; the device mode below maps it to the CPU.
    """
    cuda = torch.cuda
    cuda.current_device = lambda: 0
    cuda.current_stream = lambda device=None: _CPU_STREAM
    cuda.default_stream = lambda device=None: _CPU_STREAM
    cuda.Stream = _CpuStream
    cuda.Event = _CpuEvent
    cuda.stream = lambda stream=None: contextlib.nullcontext()
    cuda.synchronize = lambda device=None: None


# --------------------------------------------------------------------------- device mode
def _is_cuda_device(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    # A bare int as a device means cuda:<int> for torch factory functions.
    return isinstance(device, int) and not isinstance(device, bool)


_CUDA_TYPE_NAMES = {f"torch.{where}{kind}": f"torch.cuda.{kind}" for where in ("", "meta.")
                    for kind in ("FloatTensor", "HalfTensor", "BFloat16Tensor")}
"""CPU and meta tensor type names -> the CUDA ones Megatron's optimizers and clip_grads insist on."""


class CudaToCpuMode(TorchFunctionMode):
    """Maps every CUDA placement to ``target`` (the CPU) and lets its tensors pass CUDA type checks.

    - ``device=`` arguments (``"cuda"``, ``torch.device("cuda", i)``, a bare index) -> ``target``
      (schedules, optimizer, clip_grads, grad buffers and many more use them);
    - ``Tensor.cuda()``/``Tensor.to(<cuda>)`` -> ``target`` (meta tensors stay meta: planning builds);
      ``pin_memory`` is a no-op;
    - ``Tensor.type()`` reports ``torch.cuda.FloatTensor`` etc. because the optimizers and
      clip_grads check ``param.type() == 'torch.cuda.FloatTensor'`` and reject anything else;
    - ``record_stream`` is a no-op.
    """

    target = torch.device("cpu")

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return _CUDA_TYPE_NAMES.get(name, name)
        if func is torch.Tensor.cuda:
            return args[0] if args[0].is_meta else args[0].to(self.target)
        if func is torch.Tensor.pin_memory:
            return args[0]
        if func is torch.Tensor.record_stream:
            return None
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], self.target, *args[2:])
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            kwargs["device"] = self.target
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        if func in (torch.autograd.backward, torch.Tensor.backward):
            return self._backward(func, args, kwargs)
        return func(*args, **kwargs)

    def _backward(self, func, args, kwargs):
        """Run the autograd engine with this mode active.

        A mode is popped while its handler runs, and torch.autograd.backward dispatches to the
        mode: calling it from here would run Megatron's custom autograd backwards (alltoall, SP
        gathers allocate on ``torch.cuda.current_device()``) unmapped. Megatron's schedules call
        the engine directly (deallocate_pipeline_outputs=True, see models.builder); this covers
        a plain ``loss.backward()``.
        """
        names = ("gradient" if func is torch.Tensor.backward else "grad_tensors", "retain_graph", "create_graph")
        params = dict(zip(names, args[1:])) | kwargs
        if params.get("inputs") is not None:
            return func(*args, **kwargs)  # partial backward: rare, leave to torch
        tensors = args[0] if isinstance(args[0], (tuple, list)) else (args[0],)
        grads = params.get(names[0])
        grads = grads if isinstance(grads, (tuple, list)) else (grads,) * len(tensors)
        grads = tuple(torch.ones_like(t) if g is None else g for t, g in zip(tensors, grads))
        create = bool(params.get("create_graph", False))
        retain = params.get("retain_graph")
        with self:
            torch.autograd.Variable._execution_engine.run_backward(
                tensors=tuple(tensors), grad_tensors=grads, keep_graph=create if retain is None else retain,
                create_graph=create, inputs=(), allow_unreachable=True, accumulate_grad=True)


class CudaToMetaMode(CudaToCpuMode):
    """Maps every CUDA placement to the ``meta`` device instead: a device-placement emulation for CPU CI.

    Under CudaToCpuMode "placed on the device" and "left on the CPU" look the same; here a tensor
    that reached the device is on ``meta`` and one that never did is still on the CPU. Meant to
    run on top of the CPU shims (which stub torch.cuda); tensors hold no storage, so whatever reads
    values (``.item()``, ``.tolist()``, host copies of split sizes) stops there.
    """

    target = torch.device("meta")


def _shim_device_mode() -> None:
    """Enter CudaToCpuMode for the rest of the process (see its docstring for what it covers).

    Without it: forward/backward schedules (``device="cuda"``), DDP grad buffers,
    get_megatron_optimizer (``param.type()`` checks) and clip_grads fail.
    The mode is never exited: it must cover every later megatron call.
    """
    CudaToCpuMode().__enter__()


# --------------------------------------------------------------------------- RNG tracker
def _shim_rng_tracker() -> None:
    """Megatron's model-parallel RNG tracker keeps CPU generator states instead of CUDA ones.

    Without it: ``tensor_parallel.model_parallel_cuda_manual_seed`` (called by
    parallel.bootstrap.init_distributed) fails in ``torch.cuda.get_rng_state``; and
    ``_set_cuda_rng_state`` would silently queue its work forever (``_lazy_call`` never
    runs without CUDA), so ``tracker.fork()`` would not switch streams at all.
    """
    from megatron.core.tensor_parallel import random as mrandom

    def get_state(device="cuda", clone=False, graph_safe=False):
        return torch.get_rng_state()

    def set_state(new_state, device=-1, graph_safe=False):
        torch.set_rng_state(new_state)

    def seed(seed: int) -> None:
        # torch.manual_seed itself calls torch.cuda.manual_seed_all: seed the CPU generator directly.
        torch.default_generator.manual_seed(seed)

    mrandom._get_cuda_rng_state = get_state
    mrandom._set_cuda_rng_state = set_state
    for mod in (torch.cuda, torch.cuda.random):
        mod.get_rng_state = lambda device="cuda": torch.get_rng_state()
        mod.set_rng_state = lambda new_state, device="cuda": torch.set_rng_state(new_state)
        mod.manual_seed = seed


# --------------------------------------------------------------------------- MoE dispatch
def _shim_alltoall_splits() -> None:
    """alltoall dispatcher: split sizes become numpy arrays on CPU, as they do on GPU.

    Without it: ``maybe_move_tensor_to_cpu`` only converts CUDA tensors, so on CPU the split
    sizes stay tensors and ``all_to_all_single`` rejects them (any EP > 1 forward fails).
    """
    from megatron.core.transformer.moe import token_dispatcher

    def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
        if torch.is_tensor(tensor) and as_numpy:
            return tensor.numpy()
        return tensor

    token_dispatcher.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu


def _shim_uneven_allgather() -> None:
    """Gather with uneven split sizes over gloo: pad to the largest split, gather, trim.

    Without it: gloo's all_gather needs equal sizes, and the MoE dispatchers gather uneven
    token counts over the expert-TP group (expert_tensor_parallel_size > 1): "invalid tensor size".
    """
    from megatron.core.tensor_parallel import mappings

    orig = mappings._gather_along_first_dim

    def gather_along_first_dim(input_, group, output_split_sizes=None, use_global_buffer=False):
        if output_split_sizes is None or group.size() == 1:
            return orig(input_, group, output_split_sizes, use_global_buffer)
        sizes = [int(s) for s in output_split_sizes]
        width = max(sizes)
        padded = input_.new_zeros((width, *input_.shape[1:]))
        padded[: input_.shape[0]] = input_
        chunks = [torch.empty_like(padded) for _ in sizes]
        torch.distributed.all_gather(chunks, padded.contiguous(), group=group)
        return torch.cat([c[:s] for c, s in zip(chunks, sizes)], dim=0)

    mappings._gather_along_first_dim = gather_along_first_dim


# --------------------------------------------------------------------------- optimizer checkpoint
def _shim_dist_optimizer_step_state() -> None:
    """Loading distributed-optimizer state with torch's Adam (no apex/TE: every CPU machine, and
    CUDA nodes without either; ``apply_optimizer_shims`` applies it there too).

    Without it: torch Adam keeps a ``step`` tensor per parameter; DistributedOptimizer.load_state_dict
    restores it separately, then ``_set_main_param_and_optimizer_states`` copies every state
    tensor from the checkpoint and fails with KeyError 'step' (the checkpoint entries skip it).
    Marking ``step`` as absent (None) makes it skip that key, as it does for non-tensors.
    And load_state_dict gives every parameter the SAME ``step`` tensor (``s["step"] = step`` in its
    non-apex/TE branch; torch keeps a non-capturable step as given), which torch Adam then increments
    once per parameter: 33 parameters resumed at step 2 were at step 35 after one more step, and bias
    correction was wrong from then on. Each parameter gets its own copy after the load.
    Idempotent: both the CPU shims and ``apply_optimizer_shims`` may reach it in one process.
    """
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    orig = DistributedOptimizer._set_main_param_and_optimizer_states
    orig_load = DistributedOptimizer.load_state_dict

    def set_states(self, model_param, tensors):
        return orig(self, model_param, {"step": None, **tensors})

    def load_state_dict(self, state_dict):
        orig_load(self, state_dict)
        for state in self.optimizer.state.values():
            if isinstance(state.get("step"), torch.Tensor):
                state["step"] = state["step"].clone()

    for name, fn in (("_set_main_param_and_optimizer_states", set_states), ("load_state_dict", load_state_dict)):
        if not getattr(getattr(DistributedOptimizer, name), _MARK, False):  # each once (tests undo them apart)
            setattr(fn, _MARK, True)
            setattr(DistributedOptimizer, name, fn)


def apply_optimizer_shims() -> bool:
    """The torch-AdamW ``step`` shim wherever megatron falls back to torch's Adam (neither TE's nor
    apex's fused Adam importable), on CPU or CUDA alike; True when it is in place.

    Separate from ``apply_cpu_shims`` because the missing fused Adam is a property of the image,
    not of the device: a CUDA node without TE/apex resumed into KeyError 'step' before.
    """
    from megatron.core.optimizer import distrib_optimizer

    if distrib_optimizer.HAVE_APEX_OR_TE or "dist_optimizer_step_state" in _SKIPPED:
        return False
    check_megatron_version()  # it patches megatron's private load path, audited per version
    _shim_dist_optimizer_step_state()
    return True


# --------------------------------------------------------------------------- DSA indexer
def hadamard_rotate(x: torch.Tensor) -> torch.Tensor:
    """Orthonormal Walsh-Hadamard transform over the last dim (Sylvester order), any dtype.

    x: [..., d] with d a power of two -> [..., d], equal to ``x @ H_d / sqrt(d)``, what
    ``fast_hadamard_transform.hadamard_transform(x, scale=d ** -0.5)`` computes on GPUs.
    """
    d = x.shape[-1]
    if d < 1 or d & (d - 1):
        raise ValueError(f"Hadamard rotation needs a power-of-two last dimension, got {d} (dsa_indexer_head_dim)")
    # 16-bit inputs are rotated in fp32 and rounded once, as the kernel does: log2(d) butterfly
    # stages in bf16 would round log2(d) times.
    work = torch.float32 if x.dtype in (torch.bfloat16, torch.float16) else x.dtype
    y, half = x.reshape(-1, d).to(work), 1
    while half < d:  # butterflies: pairs (i, i + half) inside blocks of 2 * half
        blocks = y.view(-1, d // (2 * half), 2, half)
        y = torch.stack((blocks[:, :, 0] + blocks[:, :, 1], blocks[:, :, 0] - blocks[:, :, 1]), dim=2).view(-1, d)
        half *= 2
    return (y * d ** -0.5).view(x.shape).to(x.dtype)


def _shim_dsa_hadamard() -> None:
    """DSA indexer's ``rotate_activation`` in pure PyTorch (any dtype) instead of the CUDA-only kernel.

    Without it: every DSA layer's forward fails in ``dsa.rotate_activation`` ("only support bf16
    input", then "fast_hadamard_transform is not installed"). The rotation is orthonormal and applied
    to both indexer q and k, so the scores q.k (and the top-k) are those of transformers' indexer,
    which does not rotate. CUDA nodes without the kernel get the same fallback from the model
    builder (``apply_dsa_hadamard_fallback``).
    """
    from megatron.core.transformer.experimental_attention_variant import dsa

    dsa.rotate_activation = hadamard_rotate


def hadamard_fallback_needed(device: torch.device, *, kernel_importable: bool) -> bool:
    """Whether DSA's indexer rotation must run in pure torch (``hadamard_rotate``) on ``device``.

    Megatron's ``rotate_activation`` asserts the ``fast_hadamard_transform`` kernel: CUDA only, and an
    optional package (an sdist that needs nvcc; ``gpu_wheels.sh --no-optional`` leaves it out).
    """
    return device.type != "cuda" or not kernel_importable


def apply_dsa_hadamard_fallback(device: torch.device) -> bool:
    """Megatron's DSA ``rotate_activation`` -> ``hadamard_rotate`` wherever ``hadamard_fallback_needed``
    (the CPU, or a CUDA node without the kernel); True when the fallback is in place. Idempotent, logged
    once per process; only for the audited megatron-core versions (it replaces a module function).
    """
    from megatron.core.transformer.experimental_attention_variant import dsa

    needed = hadamard_fallback_needed(device, kernel_importable=dsa.hadamard_transform is not None)
    if not needed or "dsa_hadamard" in _SKIPPED:  # skipped: the CPU-shim necessity tests
        return False
    if dsa.rotate_activation is hadamard_rotate:
        return True
    version = megatron_version()
    if version not in SUPPORTED_MEGATRON_VERSIONS:
        raise MegatronVersionError(
            f"fast_hadamard_transform is not importable on {device}, and the pure-torch DSA indexer rotation "
            f"that replaces it was verified against megatron-core {', '.join(SUPPORTED_MEGATRON_VERSIONS)}, not "
            f"{version}. Fix: install fast-hadamard-transform (`pip install fast-hadamard-transform`, needs "
            f"nvcc), or megatron-core=={SUPPORTED_MEGATRON_VERSIONS[-1]}")
    dsa.rotate_activation = hadamard_rotate
    logger.warning("fast_hadamard_transform is not importable on %s: the DSA indexer's Hadamard rotation runs "
                   "in pure torch (cpu_support.hadamard_rotate, fp32 inside, same result)", device)
    return True


SHIMS: dict[str, Callable[[], None]] = {
    "torch_cuda_stubs": _shim_torch_cuda_stubs,
    "device_mode": _shim_device_mode,
    "rng_tracker": _shim_rng_tracker,
    "alltoall_splits": _shim_alltoall_splits,
    "uneven_allgather": _shim_uneven_allgather,
    "dist_optimizer_step_state": _shim_dist_optimizer_step_state,
    "dsa_hadamard": _shim_dsa_hadamard,
}
"""Every shim by name, applied in this order."""


# --------------------------------------------------------------------------- undo (tests only)
def _patched_objects() -> tuple[object, ...]:
    """Every object a shim above sets attributes on (extend it with each new shim's target)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron.core.tensor_parallel import mappings
    from megatron.core.tensor_parallel import random as mrandom
    from megatron.core.transformer.experimental_attention_variant import dsa
    from megatron.core.transformer.moe import token_dispatcher

    return (torch.cuda, torch.cuda.random, mrandom, token_dispatcher, mappings, DistributedOptimizer, dsa)


@contextlib.contextmanager
def cpu_shims_scope(*, skip: Collection[str] = (), force: bool = False):
    """``apply_cpu_shims()`` for the block only: on exit the device mode is left and every patched
    attribute is put back, so the process is as before (tests running Megatron in the pytest process;
    apply_cpu_shims alone never undoes itself, and every later test would run under CudaToCpuMode).
    """
    saved = [(obj, dict(vars(obj))) for obj in _patched_objects()]
    depth = torch._C._len_torch_function_stack()
    skipped = set(_SKIPPED)
    try:
        apply_cpu_shims(skip=skip, force=force)
        yield
    finally:
        while torch._C._len_torch_function_stack() > depth:  # modes entered in the block, device mode too
            torch._C._pop_torch_function_stack()
        for obj, before in saved:
            for name in set(vars(obj)) - set(before):
                delattr(obj, name)
            for name, value in before.items():
                if vars(obj).get(name) is not value:
                    setattr(obj, name, value)
        _SKIPPED.clear()  # the block's skip list ends with it (apply_optimizer_shims reads it)
        _SKIPPED.update(skipped)
