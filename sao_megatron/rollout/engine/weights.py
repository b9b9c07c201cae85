"""Weight updates of the embedded engine with SGLang 0.5.23's semantics.

Sources read: ``srt/model_executor/model_runner_components/weight_updater.py``
(named update groups, ``rank = rank_offset + tp_rank``, per-tensor async
broadcasts from group rank 0 or one uint8 broadcast per ``flattened_bucket``),
``srt/managers/scheduler_components/weight_updater.py`` (updates only inside a
begin/end session) and ``srt/utils/weight_checker.py`` (checksums).

Everything that blocks (rendezvous, receives, file reads) runs off the engine
thread; only ``load`` (an in-place copy into the live parameters) runs on it,
between two forwards. This engine is one CPU rank: ``tp_rank`` is 0 and the
backend is gloo (NCCL needs GPU tensors, which this engine does not hold).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from sao_megatron.rollout.update_group import (
    FLATTENED_BUCKET, init_custom_process_group, torch_dtype, unflatten_bucket)
from sao_megatron.rollout.weight_check import held_checksums, held_name, overall_checksum, skipped

logger = logging.getLogger(__name__)

NamedTensors = list[tuple[str, torch.Tensor]]


@dataclass(frozen=True, slots=True)
class Slot:
    """Where one checkpoint tensor lives in the model: a parameter and a contiguous range, or indices."""

    param: str
    shape: tuple[int, ...]
    start: int = 0
    index: torch.Tensor | None = None
    """Flat element indices into ``param`` when the range is not contiguous (e.g. a transposed layout)."""


def checkpoint_slots(model: torch.nn.Module) -> dict[str, Slot]:
    """Checkpoint name → slot, derived from transformers' own reverse conversion (no per-family table).

    Reverted tensors that are contiguous views of a parameter give their range directly; the
    parameters left (fused ones the reversal copies, e.g. experts' gate_up_proj) are reverted once
    more holding their own flat element indices, which says where each checkpoint tensor lives.
    """
    from transformers.core_model_loading import revert_weight_conversion

    params = {n: p.detach() for n, p in model.state_dict(keep_vars=True).items()}
    owner = {}
    for name, p in params.items():
        owner.setdefault(p.untyped_storage().data_ptr(), name)
    slots, used = {}, set()
    for key, t in revert_weight_conversion(model, dict(params)).items():
        param = owner.get(t.untyped_storage().data_ptr())
        if param is not None and t.is_contiguous():
            slots[key] = Slot(param, tuple(t.shape), t.storage_offset() - params[param].storage_offset())
            used.add(param)
    shared = {params[u].untyped_storage().data_ptr() for u in used}
    probes, bases, base = {}, {}, 0
    for name, p in params.items():
        if name not in used and p.untyped_storage().data_ptr() not in shared:
            # distinct global values: a reverted element names its parameter and its place in it
            probes[name], bases[name] = torch.arange(base, base + p.numel()).view(p.shape), base
            base += p.numel()
    for key, idx in revert_weight_conversion(model, probes).items():
        if key in slots:
            continue
        flat = idx.reshape(-1)
        param = next(n for n, b in bases.items() if b <= int(flat[0]) < b + probes[n].numel())
        local = flat - bases[param]
        contiguous = bool(torch.equal(local, torch.arange(int(local[0]), int(local[0]) + local.numel())))
        slots[key] = Slot(param, tuple(idx.shape), int(local[0]), None if contiguous else local.clone())
    return slots


_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                       "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
                       "U8": torch.uint8, "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn,
                       "F8_E5M2": torch.float8_e5m2}


@dataclass(frozen=True, slots=True)
class FileTensor:
    """Where one tensor's bytes lie in a safetensors file."""

    name: str
    path: Path
    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]


def safetensors_entries(path: Path) -> list[FileTensor]:
    """The tensors of one safetensors file from its header (8-byte little-endian length, JSON), unread."""
    with open(path, "rb") as fh:
        size = int.from_bytes(fh.read(8), "little")
        header = json.loads(fh.read(size))
    out = []
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        dtype = _SAFETENSORS_DTYPES.get(meta["dtype"])
        if dtype is None:
            raise ValueError(f"{path}: tensor {name!r} has dtype {meta['dtype']}, which this engine cannot load")
        start, end = meta["data_offsets"]
        shape = tuple(int(d) for d in meta["shape"])
        if end - start != torch.Size(shape).numel() * dtype.itemsize:
            raise ValueError(f"{path}: tensor {name!r} spans {end - start} bytes, not its shape {list(shape)}")
        out.append(FileTensor(name, path, 8 + size + start, end - start, dtype, shape))
    return out


class EngineWeights:
    """Update groups, receives, in-place loads and checksums over one ``ModelRunner``."""

    def __init__(self, runner, *, timeout_s: float = 300.0):
        self.runner = runner
        self.timeout = timedelta(seconds=timeout_s)
        self.groups: dict[str, dist.ProcessGroup] = {}
        self.snapshot: dict[str, torch.Tensor] | None = None
        self._slots: dict[str, Slot] | None = None
        self._flat: dict[str, torch.Tensor] = {}
        self._slots_model = None
        # Reused for every flattened bucket: a fresh buffer per push costs a page fault per 4 KiB
        # (measured 50-80 ms for 44 MB against 26 ms for the broadcast itself). Two, so that bucket
        # k+1 is received while bucket k is loaded; a slot's views live until its ``load`` returns,
        # and the update route waits for that load before receiving into the slot again.
        self._recv_bufs = [torch.empty(0, dtype=torch.uint8) for _ in range(2)]

    # ---------------------------------------------------------------- update groups
    def init_group(self, *, master_address: str, master_port: int, rank_offset: int, world_size: int,
                   group_name: str, backend: str) -> tuple[bool, str]:
        """Join ``group_name`` as rank ``rank_offset`` (blocks until every rank joined or the timeout)."""
        if not group_name:
            return False, "Group name cannot be empty"
        if backend != "gloo":
            return False, (f"Failed to initialize custom process group: backend {backend!r} needs GPU tensors; "
                           "the embedded CPU engine joins update groups with backend 'gloo'.")
        if group_name in self.groups:  # a restarted sender rebuilds its group under the same name
            self.destroy_group(group_name)
        try:
            self.groups[group_name] = init_custom_process_group(
                backend=backend, master_address=master_address, master_port=master_port, world_size=world_size,
                rank=rank_offset, group_name=group_name, timeout=self.timeout)
        except Exception as exc:  # noqa: BLE001 - reported to the caller as SGLang does
            return False, f"Failed to initialize custom process group: {exc}."
        return True, "Succeeded to initialize custom process group."

    def destroy_group(self, group_name: str) -> tuple[bool, str]:
        group = self.groups.pop(group_name, None)
        if group is None:
            return False, "The group to be destroyed does not exist."
        try:
            dist.destroy_process_group(group)
        except Exception as exc:  # noqa: BLE001
            return False, f"Failed to destroy custom process group: {exc}."
        return True, "Succeeded to destroy custom process group."

    def receive(self, names: list[str], dtypes: list[str], shapes: list[list[int]], group_name: str,
                load_format: str | None, slot: int = 0) -> NamedTensors:
        """The announced tensors, broadcast by rank 0 of ``group_name`` (blocking, bounded by the timeout);
        a flattened bucket lands in receive buffer ``slot`` (0 or 1), whose previous views the caller
        no longer uses."""
        if group_name not in self.groups:
            raise ValueError(f"Group {group_name} not in {list(self.groups)}. "
                             "Please call `init_weights_update_group` first.")
        group = self.groups[group_name]
        torch_dtypes = [torch_dtype(d) for d in dtypes]
        if load_format == FLATTENED_BUCKET:
            sizes = [torch.Size(s).numel() * d.itemsize for d, s in zip(torch_dtypes, shapes)]
            buf = self._bucket_buffer(sum(sizes), slot)
            unflatten_bucket(buf, torch_dtypes, shapes)  # layout checks before joining the broadcast
            try:
                dist.broadcast(buf, src=0, group=group)
            except BaseException:  # an abandoned collective may still write into it: never reuse it
                self._recv_bufs[slot] = torch.empty(0, dtype=torch.uint8)
                raise
            return list(zip(names, unflatten_bucket(buf, torch_dtypes, shapes)))
        if load_format is not None:
            raise ValueError(f"unsupported load_format {load_format!r} (None or {FLATTENED_BUCKET!r})")
        out = [(n, torch.empty(s, dtype=d)) for n, d, s in zip(names, torch_dtypes, shapes, strict=True)]
        handles = [dist.broadcast(t, src=0, group=group, async_op=True) for _, t in out]
        for handle in handles:
            handle.wait()
        return out

    def _bucket_buffer(self, nbytes: int, slot: int) -> torch.Tensor:
        """The first ``nbytes`` of receive buffer ``slot`` (grown to the largest bucket seen)."""
        if self._recv_bufs[slot].numel() < nbytes:
            self._recv_bufs[slot] = torch.empty(0, dtype=torch.uint8)  # free the old one before allocating
            self._recv_bufs[slot] = torch.empty(nbytes, dtype=torch.uint8)
        return self._recv_bufs[slot][:nbytes]

    # ---------------------------------------------------------------- loading
    def slots(self) -> dict[str, Slot]:
        if self._slots is None or self._slots_model is not self.runner.model:
            model = self.runner.model
            self._slots, self._slots_model = checkpoint_slots(model), model
            # flat views of the live parameters, built once per model (state_dict walks every module)
            self._flat = {n: p.data.view(-1) for n, p in model.state_dict(keep_vars=True).items()}
        return self._slots

    def check_loadable(self, named: NamedTensors) -> None:
        """ValueError naming the first tensor that the live model does not have or has in another size."""
        slots = self.slots()
        for name, tensor in named:
            if name not in slots:
                raise ValueError(f"the served model has no tensor {name!r}")
            if tuple(slots[name].shape) != tuple(tensor.shape):
                raise ValueError(f"tensor {name!r} has shape {list(tensor.shape)}, the served model "
                                 f"{list(slots[name].shape)}")

    @torch.no_grad()
    def load(self, named: NamedTensors) -> None:
        """(engine thread) Copy checkpoint tensors into the live parameters, converting to their dtype."""
        slots = self.slots()
        for name, tensor in named:
            slot = slots[name]
            flat = self._flat[slot.param]
            if slot.index is None:
                flat[slot.start:slot.start + tensor.numel()].copy_(tensor.reshape(-1))
            else:
                flat[slot.index] = tensor.reshape(-1).to(flat.dtype)

    def read_checkpoint(self, model_dir: str | Path) -> NamedTensors:
        """Every tensor of an HF safetensors directory, checked against the live model; ValueError otherwise."""
        from safetensors.torch import load_file

        entries = self.plan_checkpoint(model_dir)
        wanted = {e.name for e in entries}
        return [(n, t) for f in sorted({e.path for e in entries}) for n, t in load_file(f).items() if n in wanted]

    def plan_checkpoint(self, model_dir: str | Path) -> list[FileTensor]:
        """Where every tensor of an HF safetensors directory lies, checked against the live model from the
        headers alone (config, names, shapes, nothing missing); ValueError otherwise."""
        from sao_megatron.rollout.engine.model import is_mtp_tensor, read_config

        model_dir = Path(model_dir)
        if not model_dir.is_dir():
            raise ValueError(f"model_path {model_dir} is not a directory")
        new_cfg, live_cfg = read_config(model_dir), self.runner.config_dict
        diff = sorted(k for k in set(new_cfg) | set(live_cfg) if new_cfg.get(k) != live_cfg.get(k))
        if diff:
            raise ValueError(f"config.json in {model_dir} differs from the served model in {diff[:8]}: "
                             f"an update must keep the architecture")
        config = self.runner.model.config  # MTP layers: in the checkpoint, not in the served model
        entries = [e for f in sorted(model_dir.glob("*.safetensors")) for e in safetensors_entries(f)
                   if not is_mtp_tensor(e.name, config)]
        self.check_loadable([(e.name, torch.empty(e.shape, device="meta")) for e in entries])
        missing = sorted(set(self.slots()) - {e.name for e in entries})
        if missing:
            raise ValueError(f"tensors in {model_dir} lack {len(missing)} of the served model's tensors, "
                             f"e.g. {missing[:5]}")
        return entries

    @torch.no_grad()
    def read_into_live(self, entries: list[FileTensor]) -> None:
        """(engine thread) Read each tensor's bytes straight into its live parameter range (the floor's one
        copy: no tensor allocated per file, no second copy); a converted or scattered one via ``load``.
        OSError when a file is shorter than its header says (the weights are then partly updated)."""
        slots = self.slots()
        for path in sorted({e.path for e in entries}):
            with open(path, "rb", buffering=0) as fh:
                for e in sorted((e for e in entries if e.path == path), key=lambda e: e.offset):
                    slot, flat = slots[e.name], self._flat[slots[e.name].param]
                    numel = e.nbytes // e.dtype.itemsize
                    direct = slot.index is None and flat.dtype == e.dtype
                    dest = flat[slot.start:slot.start + numel] if direct else torch.empty(numel, dtype=e.dtype)
                    fh.seek(e.offset)
                    view, got = memoryview(dest.view(torch.uint8).numpy()), 0
                    while got < e.nbytes:  # one read returns at most ~2 GiB on Linux
                        n = fh.readinto(view[got:])
                        if not n:
                            raise OSError(f"{path} ends inside tensor {e.name!r}")
                        got += n
                    if not direct:
                        self.load([(e.name, dest.view(e.shape))])

    # ---------------------------------------------------------------- /weights_checker
    def _state(self, skip_tensor_list: list[str] | None) -> dict[str, torch.Tensor]:
        """The live weights under checkpoint (HF) names, as ``save_pretrained`` would write them
        (this engine's parameters are transformers' modules, fused differently from SGLang's)."""
        from transformers.core_model_loading import revert_weight_conversion

        model = self.runner.model
        state = revert_weight_conversion(model, {n: t.detach() for n, t in model.state_dict().items()})
        return {n: t for n, t in state.items() if not skipped(n, skip_tensor_list)}

    def check(self, action: str, skip_tensor_list: list[str] | None) -> dict | None:
        """SGLang's WeightChecker actions; the checksum payload for ``checksum``, else None."""
        if action == "checksum":  # under SGLang's parameter names (qkv_proj, experts.w13_weight...), as it does
            sums = held_checksums(self._state(skip_tensor_list).items())
            info = {"role": "target", "tp_rank": 0, "tp_size": 1, "dp_rank": 0, "dp_size": 1, "pp_rank": 0,
                    "pp_size": 1, "rank": 0, "size": 1}
            return {"checksums": sums, "per_gpu_checksum": overall_checksum(sums), "parallelism_info": [info]}
        if action == "snapshot":
            self.snapshot = {n: t.clone() for n, t in self._state(None).items()}
            return None
        if action == "compare":
            if self.snapshot is None:
                raise ValueError("compare needs a snapshot first (action=snapshot)")
            live = self._state(skip_tensor_list)
            bad = sorted({held_name(n) for n, t in live.items()
                          if n in self.snapshot and not torch.equal(t, self.snapshot[n])})
            self.snapshot = None
            if bad:
                raise ValueError("check tensor equality failed:\n" + "\n".join(f"name={n}" for n in bad))
            return None
        raise ValueError(f"Unsupported action={action!r}")
