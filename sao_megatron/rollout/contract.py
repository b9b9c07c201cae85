"""Check payloads against SGLang's own definitions from the pinned wheel (sglang 0.5.23).

``scripts/sglang_contract.sh`` (run by ``scripts/setup.sh``) copies single files
of the pinned sglang wheel into ``<venv>/sglang_contract/``:
- ``api_types.py``: generated msgspec types of the HTTP JSON API; /generate
  requests and replies, /model_info, /server_info, /abort_request are decoded
  with it (its ``decode_*`` functions raise on a contract violation);
- ``io_struct.py``: the request structs of the control plane (pause, weight
  updates, ...). It imports half of SGLang, so it is not imported: its class
  bodies are read with ``ast`` into field schemas (name, annotation, required);
- ``weight_versions.py`` (+ ``msgspec_utils.py``, which it imports): how the
  scheduler records weight-version events and turns them into the
  ``weight_versions`` spans of a reply; the span reader is tested against it;
- model, loader and quantization files (``deepseek_weight_loader.py``, ``qwen3_moe.py``,
  ``fp8.py``, ...): read with ``ast`` (:func:`source_tree`), and single functions executed
  (:func:`source_function`), to test ``rollout/loader_groups.py`` and ``weights/fp8_block.py``
  against SGLang's own loading code; ``tensor_bucket.py`` (torch only) is imported whole.

Used by the contract tests and usable as a ``RolloutClient(on_exchange=...)``
hook when debugging against a new SGLang version.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

PINNED_SGLANG = "0.5.23"

# Control endpoint → request struct in io_struct.py (as routed by http_server.py of the same version).
CONTROL_REQUESTS: dict[str, str] = {
    "/pause_generation": "PauseGenerationReqInput",
    "/continue_generation": "ContinueGenerationReqInput",
    "/abort_request": "AbortReq",
    "/begin_weight_update": "BeginWeightUpdateReqInput",
    "/end_weight_update": "EndWeightUpdateReqInput",
    "/update_weights_from_disk": "UpdateWeightFromDiskReqInput",
    "/init_weights_update_group": "InitWeightsUpdateGroupReqInput",
    "/update_weights_from_distributed": "UpdateWeightsFromDistributedReqInput",
    "/destroy_weights_update_group": "DestroyWeightsUpdateGroupReqInput",
    "/weights_checker": "CheckWeightsReqInput",
}


class ContractError(ValueError):
    """A payload does not match SGLang's definition."""


def contract_dir() -> Path:
    """``<venv>/sglang_contract`` of the running interpreter, version-checked."""
    path = Path(sys.prefix) / "sglang_contract"
    version_file = path / "VERSION"
    if not version_file.is_file():
        raise FileNotFoundError(f"{path} is missing: run `bash scripts/setup.sh` to build the venv with the "
                                f"SGLang contract files")
    version = version_file.read_text().strip()
    if version != PINNED_SGLANG:
        raise ContractError(f"{path} holds sglang {version}, this code targets {PINNED_SGLANG}")
    return path


@functools.cache
def api_types() -> ModuleType:
    """SGLang's generated ``api_types.py`` loaded by file path (needs only msgspec)."""
    spec = importlib.util.spec_from_file_location("sglang_contract_api_types", contract_dir() / "api_types.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@functools.cache
def weight_versions() -> ModuleType:
    """SGLang's ``srt/utils/weight_versions.py`` (events -> spans), loaded by file path.

    Its one SGLang import, ``sglang.srt.utils.msgspec_utils``, is served from the contract copy
    while the file executes and removed from ``sys.modules`` afterwards.
    """
    helper = _load_contract_file("sglang_contract_msgspec_utils", "msgspec_utils.py")
    name = "sglang.srt.utils.msgspec_utils"
    previous = sys.modules.get(name)
    sys.modules[name] = helper
    try:
        return _load_contract_file("sglang_contract_weight_versions", "weight_versions.py")
    finally:
        if previous is None:
            del sys.modules[name]
        else:
            sys.modules[name] = previous


def _load_contract_file(module_name: str, file_name: str) -> ModuleType:
    path = contract_dir() / file_name
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: run `bash scripts/sglang_contract.sh <venv>` (or "
                                f"`bash scripts/setup.sh`) to extract the SGLang contract files")
    spec = importlib.util.spec_from_file_location(module_name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # dataclasses and msgspec resolve annotations through it
    spec.loader.exec_module(module)
    return module


@functools.cache
def tensor_bucket() -> ModuleType:
    """SGLang's ``srt/weight_sync/tensor_bucket.py`` (``FlattenedTensorBucket``), loaded by file path."""
    return _load_contract_file("sglang_contract_tensor_bucket", "tensor_bucket.py")


@functools.cache
def source_tree(file_name: str) -> ast.Module:
    """The ``ast`` of one extracted SGLang file (most import half of SGLang and CUDA: read, not imported)."""
    path = contract_dir() / file_name
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: run `bash scripts/sglang_contract.sh <venv>` to extract it")
    return ast.parse(path.read_text(), filename=str(path))


def source_function(file_name: str, qualname: str, namespace: dict[str, Any]) -> Any:
    """One function of an SGLang file (``name`` or ``Class.method``, decorators dropped), defined in ``namespace``.

    For functions whose imports the caller supplies in ``namespace``; a method comes back unbound
    (its ``cls``/``self`` is the first argument).
    """
    node: Any = source_tree(file_name)
    for part in qualname.split("."):
        node = next((n for n in node.body if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name == part),
                    None)
        if node is None:
            raise KeyError(f"{qualname} not found in {file_name} of sglang {PINNED_SGLANG}")
    func = ast.FunctionDef(**{**{f: getattr(node, f) for f in node._fields}, "decorator_list": []})
    module = ast.fix_missing_locations(ast.Module(body=[func], type_ignores=[]))
    exec(compile(module, f"<sglang {file_name}:{qualname}>", "exec"), namespace)  # noqa: S102 - pinned wheel code
    return namespace[node.name]


def check_generate_request(payload: Any) -> None:
    _decode("decode_GenerateRequest", payload)


def check_generate_reply(reply: Any) -> None:
    _decode("decode_GenerateResponse", reply)


def _decode(fn: str, value: Any) -> Any:
    module = api_types()
    try:
        return getattr(module, fn)(value)
    except module.JsonContractError as exc:
        raise ContractError(f"{fn.removeprefix('decode_')}: {exc}") from None


@dataclass(frozen=True)
class FieldSpec:
    name: str
    annotation: str
    required: bool


@functools.cache
def io_struct_schema(class_name: str) -> dict[str, FieldSpec]:
    """Fields of a request struct in io_struct.py, base classes (BaseReq) included."""
    classes = _io_struct_classes()
    if class_name not in classes:
        raise KeyError(f"{class_name} not found in io_struct.py of sglang {PINNED_SGLANG}")
    node = classes[class_name]
    fields: dict[str, FieldSpec] = {}
    for base in node.bases:
        if isinstance(base, ast.Name) and base.id in classes:
            fields.update(io_struct_schema(base.id))
    for stmt in node.body:
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            fields[stmt.target.id] = FieldSpec(stmt.target.id, ast.unparse(stmt.annotation), stmt.value is None)
    return fields


@functools.cache
def _io_struct_classes() -> dict[str, ast.ClassDef]:
    tree = ast.parse((contract_dir() / "io_struct.py").read_text())
    return {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}


def check_control_request(path: str, payload: dict[str, Any] | None) -> None:
    """Keys, required fields and simple types of a control payload vs its io_struct class."""
    schema = io_struct_schema(CONTROL_REQUESTS[path])
    payload = payload or {}
    unknown = set(payload) - set(schema)
    if unknown:
        raise ContractError(f"{path}: unknown fields {sorted(unknown)}; {CONTROL_REQUESTS[path]} has "
                            f"{sorted(schema)}")
    missing = [f.name for f in schema.values() if f.required and f.name not in payload]
    if missing:
        raise ContractError(f"{path}: required fields {missing} missing")
    for key, value in payload.items():
        if not _matches(value, ast.parse(schema[key].annotation, mode="eval").body):
            raise ContractError(f"{path}: field {key}={value!r} does not match {schema[key].annotation}")


_SCALARS = {"str": (str,), "int": (int,), "float": (int, float), "bool": (bool,)}


def _matches(value: Any, ann: ast.expr) -> bool:
    """A small structural type check for the annotations used by the control structs."""
    if isinstance(ann, ast.Constant) and ann.value is None:
        return value is None
    if isinstance(ann, ast.Name):
        if ann.id in _SCALARS:
            return isinstance(value, _SCALARS[ann.id]) and (ann.id == "bool" or not isinstance(value, bool))
        return True  # Any and named helper types: not checked here
    if isinstance(ann, ast.Subscript) and isinstance(ann.value, ast.Name):
        outer, inner = ann.value.id, ann.slice
        args = list(inner.elts) if isinstance(inner, ast.Tuple) else [inner]
        if outer == "Optional":
            return value is None or _matches(value, args[0])
        if outer == "Union":
            return any(_matches(value, a) for a in args)
        if outer == "List":
            return isinstance(value, list) and all(_matches(v, args[0]) for v in value)
        if outer == "Dict":
            return isinstance(value, dict) and all(_matches(v, args[1]) for v in value.values())
        if outer == "Literal":
            return value in [a.value for a in args if isinstance(a, ast.Constant)]
    return True


def check_exchange(path: str, payload: Any, reply: Any) -> None:
    """A ``RolloutClient(on_exchange=...)`` hook: raises ContractError on any mismatch."""
    if path == "/generate":
        check_generate_request(payload)
        check_generate_reply(reply)
    elif path in CONTROL_REQUESTS:
        check_control_request(path, payload)
    elif path == "/model_info":
        _decode("decode_GetModelInfoResponse", reply)
    elif path == "/server_info":
        _decode("decode_GetServerInfoResponse", reply)
