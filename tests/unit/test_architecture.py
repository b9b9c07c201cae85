"""Architecture rules of docs/contributing.md and docs/architecture.md, checked on the source tree.

- every YAML under configs/ loads as an ExperimentConfig and validates;
- sao_megatron/algorithms is pure tensor maths (no megatron, torch.distributed, config objects);
- the library never imports configs/, slurm/, checkpoints_tools/, tests/ (the lazy `_VERBS`
  string table in sao_megatron/cli.py is the one place that may name such modules);
- every config dataclass field carries a docstring (a string literal right under it);
- no print() in the library outside cli modules;
- imports only point down the floors (docs/architecture.md#the-floor-rule) and form no circle;
- every config field is read by the library;
- the repository refers to nothing outside itself.
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import pathlib
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.unit

ROOT = pathlib.Path(__file__).resolve().parents[2]
LIB = ROOT / "sao_megatron"
FORBIDDEN_TOP = {"checkpoints_tools", "slurm", "configs", "tests"}
MODULE_STRING = re.compile(r"^(checkpoints_tools|slurm|configs|tests)(\.[A-Za-z_]\w*)+$")


def lib_files() -> list[pathlib.Path]:
    return sorted(p for p in LIB.rglob("*.py") if "__pycache__" not in p.parts)


def parse(path: pathlib.Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def rel(path: pathlib.Path) -> str:
    return str(path.relative_to(ROOT))


def imported_modules(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import statement, including names imported from a package."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.lineno, node.module))
            out += [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
    return out


def dynamic_imports(tree: ast.AST) -> list[tuple[int, str]]:
    """Constant module names passed to importlib.import_module / __import__."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name in {"import_module", "__import__"} and isinstance(node.args[0].value, str):
                out.append((node.lineno, node.args[0].value))
    return out


# ---------------------------------------------------------------- 1. configs/ YAML


def config_yamls() -> list[pathlib.Path]:
    """Experiment and model YAML (configs/studies/ holds study files: checked below)."""
    return sorted(p for p in (ROOT / "configs").rglob("*.yaml") if "studies" not in p.relative_to(ROOT).parts)


@pytest.mark.parametrize("path", sorted((ROOT / "configs" / "studies").glob("*.yaml")), ids=lambda p: p.name)
def test_every_study_file_loads_and_its_variants_resolve(path, tmp_path):
    from sao_megatron.study.spec import build_plan, load_study

    spec, base = load_study(path)
    plan = build_plan(spec, base, tmp_path, variants=list(spec.variants), seeds=1)
    # Variants may name options of pending issue-16 work (listed as not runnable); the default study must run.
    assert plan.runs and not set(spec.default) & set(plan.errors)


def test_there_are_configs_to_check():
    names = {p.relative_to(ROOT / "configs").as_posix() for p in config_yamls()}
    assert "models/tiny_moe.yaml" in names


@pytest.mark.parametrize("path", config_yamls(), ids=lambda p: p.relative_to(ROOT / "configs").as_posix())
def test_every_yaml_in_configs_loads_and_validates(path):
    from sao_megatron.config import ExperimentConfig, load_config, validate

    cfg = load_config(path, check=False)  # strict types
    loaded = copy.deepcopy(cfg)
    validate(cfg)  # cross-field validation refuses; it never rewrites what was loaded
    assert isinstance(cfg, ExperimentConfig) and cfg == loaded


# ---------------------------------------------------------------- 2. algorithms/ is pure maths


def test_algorithms_import_no_megatron_distributed_or_config_statically():
    bad = []
    for path in sorted((LIB / "algorithms").rglob("*.py")):
        for line, mod in imported_modules(parse(path)) + dynamic_imports(parse(path)):
            if (mod.split(".")[0] == "megatron" or mod.startswith("torch.distributed")
                    or mod.startswith("sao_megatron.config") or mod.startswith("sao_megatron.training")
                    or mod.startswith("sao_megatron.models")):
                bad.append(f"{rel(path)}:{line} imports {mod}")
    assert not bad, "sao_megatron/algorithms must stay pure tensor maths:\n" + "\n".join(bad)


def test_algorithms_do_not_pull_megatron_in_transitively():
    modules = sorted(".".join(p.relative_to(ROOT).with_suffix("").parts)
                     for p in (LIB / "algorithms").rglob("*.py") if "__pycache__" not in p.parts)
    code = ("import importlib, sys\n"
            f"for m in {modules!r}: importlib.import_module(m.removesuffix('.__init__'))\n"
            "bad = sorted(m for m in sys.modules if m.split('.')[0] == 'megatron' or m == 'sao_megatron.config')\n"
            "print(bad)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", f"importing sao_megatron.algorithms loads {out.stdout.strip()}"


# ---------------------------------------------------------------- 3. one-way imports


def verbs_table_strings(tree: ast.Module) -> set[int]:
    """ids of the string constants that are values of the `_VERBS` dict in sao_megatron/cli.py."""
    for node in tree.body:
        target = node.target if isinstance(node, ast.AnnAssign) else (
            node.targets[0] if isinstance(node, ast.Assign) else None)
        if isinstance(target, ast.Name) and target.id == "_VERBS" and isinstance(node.value, ast.Dict):
            return {id(v) for v in node.value.values}
    raise AssertionError("sao_megatron/cli.py has no _VERBS dict literal")


def test_library_never_imports_configs_slurm_tools_or_tests():
    bad = []
    for path in lib_files():
        tree = parse(path)
        for line, mod in imported_modules(tree) + dynamic_imports(tree):
            if mod.split(".")[0] in FORBIDDEN_TOP:
                bad.append(f"{rel(path)}:{line} imports {mod}")
        allowed = verbs_table_strings(tree) if path == LIB / "cli.py" else set()
        for node in ast.walk(tree):
            if (isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in allowed
                    and MODULE_STRING.match(node.value)):
                bad.append(f"{rel(path)}:{node.lineno} names module {node.value!r}")
    assert not bad, ("the library must not depend on configs/, slurm/, checkpoints_tools/, tests/:\n"
                     + "\n".join(bad))


# ---------------------------------------------------------------- 4. config field docstrings


def is_dataclass_decorator(dec: ast.expr) -> bool:
    target = dec.func if isinstance(dec, ast.Call) else dec
    name = target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", "")
    return name in {"dataclass", "cfg"}


def is_component_config_form(dec: ast.expr) -> bool:
    """``@cfg`` or ``@dataclass(kw_only=True, slots=True, ...)``: STYLE's component-config form."""
    if isinstance(dec, ast.Name):
        return dec.id == "cfg"
    if not (isinstance(dec, ast.Call) and is_dataclass_decorator(dec)):
        return False
    flags = {k.arg for k in dec.keywords if isinstance(k.value, ast.Constant) and k.value.value is True}
    return {"kw_only", "slots"} <= flags


def config_classes() -> list[tuple[pathlib.Path, ast.ClassDef]]:
    """Dataclasses in sao_megatron/config/, dataclasses named *Config, and every class in the
    component-config form (``@cfg`` / kw_only + slots dataclass) anywhere in the library."""
    out = []
    for path in lib_files():
        for node in ast.walk(parse(path)):
            if not isinstance(node, ast.ClassDef):
                continue
            decs = node.decorator_list
            if (any(is_component_config_form(d) for d in decs) or (any(is_dataclass_decorator(d) for d in decs)
                    and (path.parent == LIB / "config" or node.name.endswith("Config")))):
                out.append((path, node))
    return out


def undocumented_fields(cls: ast.ClassDef) -> list[str]:
    missing = []
    for i, stmt in enumerate(cls.body):
        if not isinstance(stmt, ast.AnnAssign) or not isinstance(stmt.target, ast.Name):
            continue
        if "ClassVar" in ast.unparse(stmt.annotation):
            continue
        nxt = cls.body[i + 1] if i + 1 < len(cls.body) else None
        documented = (isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                      and isinstance(nxt.value.value, str) and nxt.value.value.strip())
        if not documented:
            missing.append(f"{cls.name}.{stmt.target.id} (line {stmt.lineno})")
    return missing


def test_config_classes_are_found():
    names = {cls.name for _, cls in config_classes()}
    assert {"ModelConfig", "ParallelConfig", "ExperimentConfig", "ResourcesConfig", "RewardPhase"} <= names


def test_every_config_field_has_a_docstring():
    missing = [f"{rel(path)}: {m}" for path, cls in config_classes() for m in undocumented_fields(cls)]
    assert not missing, "config fields need a one-line docstring right under them:\n" + "\n".join(missing)


def test_undocumented_field_detector_catches_a_missing_docstring():
    source = 'class C:\n    a: int = 1\n    """doc"""\n    b: int = 2\n    c: int = 3\n    """doc"""\n'
    cls = ast.parse(source).body[0]
    assert undocumented_fields(cls) == ["C.b (line 4)"]


def test_schema_dataclasses_are_kw_only_and_slotted():
    from sao_megatron.config import schema

    classes = [c for c in vars(schema).values() if isinstance(c, type) and dataclasses.is_dataclass(c)]
    assert len(classes) >= 12
    for cls in classes:
        assert hasattr(cls, "__slots__"), f"{cls.__name__} must be a slots dataclass"
        assert all(f.kw_only for f in dataclasses.fields(cls)), f"{cls.__name__} must be kw_only"


# ---------------------------------------------------------------- 5. no print in the library


def is_cli_module(path: pathlib.Path) -> bool:
    return path.name == "cli.py" or path.name.endswith("_cli.py")


def test_no_print_outside_cli_modules():
    bad = []
    for path in lib_files():
        if is_cli_module(path):
            continue
        for node in ast.walk(parse(path)):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "print":
                bad.append(f"{rel(path)}:{node.lineno}")
    assert not bad, "use logging.getLogger(__name__) instead of print in the library:\n" + "\n".join(bad)


# ---------------------------------------------------------------- 6. floors: imports only point down

# Lowest first. A module may import its own package and packages on lower floors only. Every
# import counts: module level, inside functions (lazy) and under TYPE_CHECKING (a type-only
# import still couples the layers). cli.py dispatches verbs by module-name strings at runtime,
# so statically it sits just above config.
FLOORS = [
    {"errors", "net", "algorithms"},
    {"config"},
    {"cli", "parallel"},
    {"models", "envs", "rollout"},
    {"scheduler"},
    {"weights"},
    {"training"},
    {"launch", "study"},
]


def floor_of(package: str) -> int:
    for i, floor in enumerate(FLOORS):
        if package in floor:
            return i
    raise AssertionError(f"sao_megatron.{package} is on no floor: add it to FLOORS in {__file__}")


def package_of(path: pathlib.Path) -> str:
    return path.relative_to(LIB).with_suffix("").parts[0]


def floor_violations(files: list[pathlib.Path]) -> list[str]:
    bad = []
    for path in files:
        own = package_of(path)
        if own == "__init__":
            continue
        for line, mod in imported_modules(parse(path)) + dynamic_imports(parse(path)):
            parts = mod.split(".")
            if parts[0] != "sao_megatron" or len(parts) < 2 or parts[1] == own:
                continue
            if floor_of(parts[1]) >= floor_of(own):
                bad.append(f"{rel(path)}:{line} imports {mod} (floor {floor_of(parts[1])} from floor {floor_of(own)})")
    return bad


def test_every_package_is_on_a_floor():
    for path in lib_files():
        if package_of(path) != "__init__":
            floor_of(package_of(path))


def test_imports_only_point_down_the_floors():
    bad = floor_violations(lib_files())
    assert not bad, "an import runs up (or sideways) the floors of FLOORS:\n" + "\n".join(bad)


def test_floor_check_catches_an_upward_type_checking_import(monkeypatch):
    fake = LIB / "models" / "__floor_probe__.py"
    source = ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
              "    from sao_megatron.training.step.batch import LocalBatch\n")
    monkeypatch.setattr(pathlib.Path, "read_text", lambda self, *a, **k: source)
    found = floor_violations([fake])
    assert found and found[0] == f"{rel(fake)}:3 imports sao_megatron.training.step.batch (floor 6 from floor 3)"


# Inside training/ the rooms stack the same way: the step core knows nothing of a run, and the
# run lifecycle nothing of the verbs that start it.
TRAINING_ROOMS = ["step", "run", "verbs"]


def room_violations(files: list[pathlib.Path]) -> list[str]:
    bad = []
    for path in files:
        parts = path.relative_to(LIB).parts
        if parts[0] != "training" or len(parts) < 3:
            continue
        own = TRAINING_ROOMS.index(parts[1])
        for line, mod in imported_modules(parse(path)) + dynamic_imports(parse(path)):
            target = mod.split(".")
            if target[:2] == ["sao_megatron", "training"] and len(target) > 2 and target[2] in TRAINING_ROOMS:
                if TRAINING_ROOMS.index(target[2]) > own:
                    bad.append(f"{rel(path)}:{line} imports {mod} (training/{target[2]} above training/{parts[1]})")
    return bad


def test_training_rooms_import_only_downwards():
    rooms = {p.name for p in (LIB / "training").iterdir() if p.is_dir() and p.name != "__pycache__"}
    loose = sorted(p.name for p in (LIB / "training").glob("*.py") if p.name != "__init__.py")
    assert rooms == set(TRAINING_ROOMS) and not loose, f"training/ holds rooms {TRAINING_ROOMS} only: {rooms}, {loose}"
    bad = room_violations(lib_files())
    assert not bad, "an import runs up the rooms of training/:\n" + "\n".join(bad)


def test_room_check_catches_the_step_core_importing_the_run(monkeypatch):
    fake = LIB / "training" / "step" / "__room_probe__.py"
    source = "from sao_megatron.training.run import trainer\n"
    monkeypatch.setattr(pathlib.Path, "read_text", lambda self, *a, **k: source)
    found = room_violations([fake])
    assert found == [f"{rel(fake)}:1 imports sao_megatron.training.run (training/run above training/step)",
                     f"{rel(fake)}:1 imports sao_megatron.training.run.trainer (training/run above training/step)"]


# ---------------------------------------------------------------- 7. every config field is read

# A field counts as read only where code loads it as an attribute of its own config object: in a file
# that names the config class (its annotations/imports: where a variable of that type lives), or
# through the root config's field holding it (``cfg.rollout.weight_sync.bucket_mb``). Fields copied
# to Megatron by name count when a file naming the class iterates a module-level ``*_FIELDS`` table
# listing them (``getattr(model, name) for name in _MLA_FIELDS``). A string or a keyword elsewhere is
# not a read.
_SCHEMA = LIB / "config" / "schema.py"


def schema_classes() -> dict[str, type]:
    from sao_megatron.config import schema

    return {n: c for n, c in vars(schema).items() if isinstance(c, type) and dataclasses.is_dataclass(c)}


def holder_fields(classes: dict[str, type]) -> dict[str, set[str]]:
    """Per config class, the fields of other configs holding it (ActorConfig -> {"actor"})."""
    import typing

    out: dict[str, set[str]] = {n: set() for n in classes}
    for cls in classes.values():
        for field, hint in typing.get_type_hints(cls).items():
            for name, other in classes.items():
                if hint is other or other in typing.get_args(hint):
                    out[name].add(field)
    return out


def _name_tables(tree: ast.Module) -> set[str]:
    """Strings of module-level ``*_FIELDS`` tuples/lists that the module iterates (for getattr by name)."""
    tables = {node.targets[0].id: node.value for node in tree.body if isinstance(node, ast.Assign)
              and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
              and node.targets[0].id.endswith("_FIELDS") and isinstance(node.value, (ast.Tuple, ast.List))}
    iterated = {n.iter.id for n in ast.walk(tree) if isinstance(n, (ast.comprehension, ast.For))
                and isinstance(n.iter, ast.Name) and n.iter.id in tables}
    return {e.value for t in iterated for e in tables[t].elts if isinstance(e, ast.Constant)}


def reads_in(source: str, classes: dict[str, type], holders: dict[str, set[str]]) -> dict[str, set[str]]:
    """Per config class, the field names one source file reads (the rules above)."""
    tree = ast.parse(source)
    loads = [n for n in ast.walk(tree) if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Load)]
    tables = _name_tables(tree)
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} | {
        a.name.rsplit(".", 1)[-1] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names} | {
        n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)}  # "X" hints
    out = {}
    for cname in classes:
        named = cname in names
        out[cname] = {n.attr for n in loads if named or (isinstance(n.value, ast.Attribute)
                                                         and n.value.attr in holders[cname])}
        out[cname] |= tables if named else set()
    return out


def library_reads() -> dict[str, set[str]]:
    """Per config class, every field name the library reads (the schema's own definitions excluded)."""
    classes = schema_classes()
    holders = holder_fields(classes)
    reads: dict[str, set[str]] = {n: set() for n in classes}
    for path in lib_files():
        if path != _SCHEMA:
            for cname, found in reads_in(path.read_text(), classes, holders).items():
                reads[cname] |= found
    return reads


def unread_fields(reads: dict[str, set[str]]) -> list[str]:
    return [f"{name}.{f.name}" for name, cls in schema_classes().items() for f in dataclasses.fields(cls)
            if f.name not in reads[name]]


def test_every_config_field_is_read_by_the_library():
    """A setting accepted but read by nothing is a defect: act on it or refuse it in validation."""
    missing = unread_fields(library_reads())
    assert not missing, "config fields no library code reads (act on them, or refuse them in "\
                        "config/validate.py with the reason):\n" + "\n".join(missing)


def test_unread_field_detector_catches_a_field_nothing_reads():
    reads = library_reads()
    assert "num_layers" in reads["ModelConfig"] and "bucket_mb" in reads["WeightSyncConfig"]
    reads["WeightSyncConfig"].discard("bucket_mb")
    assert unread_fields(reads) == ["WeightSyncConfig.bucket_mb"]


@pytest.mark.parametrize("source,read", [
    ("def f(w: WeightSyncConfig):\n    return w.bucket_mb\n", True),
    ("def f(cfg):\n    return cfg.rollout.weight_sync.bucket_mb\n", True),  # through the field holding it
    ("X = 'bucket_mb'\n", False),  # a string is not a read
    ("def f(cfg):\n    return cfg.other.bucket_mb\n", False),  # not the weight-sync config
    ("def f(w: WeightSyncConfig):\n    w.bucket_mb = 3\n", False),  # a write
    ("def f(w: WeightSyncConfig):\n    return g(bucket_mb=1)\n", False),  # a keyword
    ("_T_FIELDS = ('bucket_mb',)\ndef f(w: WeightSyncConfig):\n"
     "    return {n: getattr(w, n) for n in _T_FIELDS}\n", True),  # a name table fed to getattr
    ("_T_FIELDS = ('bucket_mb',)\n", False),  # a table nothing iterates
])
def test_a_read_is_an_attribute_load_on_the_right_config(source, read):
    classes = schema_classes()
    found = reads_in(source, classes, holder_fields(classes))["WeightSyncConfig"]
    assert ("bucket_mb" in found) == read


# ---------------------------------------------------------------- 8. no import circle

# Imports that still close a circle, each with the move that breaks it: the check runs without
# them, and fails when one no longer closes a circle, so the list only shrinks.
KNOWN_CIRCLE_IMPORTS: set[tuple[str, str]] = set()


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(files: list[pathlib.Path]) -> dict[str, set[str]]:
    """module -> the library modules it imports (every import: module level, lazy, TYPE_CHECKING).

    ``from pkg import sub`` depends on the module ``pkg.sub``; ``from mod import name`` on ``mod``.
    """
    modules = {module_name(p): p for p in files}

    def owner(name: str) -> str:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name

    graph = {}
    for name, path in modules.items():
        targets = set()
        for node in ast.walk(parse(path)):
            if isinstance(node, ast.Import):
                targets |= {owner(a.name) for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                targets |= {owner(f"{node.module}.{a.name}") for a in node.names}
        graph[name] = {t for t in targets if t.startswith("sao_megatron") and t != name}
    return graph


def import_circles(graph: dict[str, set[str]]) -> list[tuple[str, ...]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = [stack.pop()]
            while comp[-1] != v:
                comp.append(stack.pop())
            if len(comp) > 1:
                circles.append(tuple(sorted(comp)))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(circles)


def test_no_import_circle_among_the_library_modules():
    graph = import_graph(lib_files())
    for importer, imported in KNOWN_CIRCLE_IMPORTS:
        assert any({importer, imported} <= set(c) for c in import_circles(graph)), \
            f"{importer} -> {imported} closes no circle any more: remove it from KNOWN_CIRCLE_IMPORTS"
        graph[importer].discard(imported)
    circles = import_circles(graph)
    assert not circles, "modules that import each other (move what both need into a module both import):\n" + \
        "\n".join(" <-> ".join(c) for c in circles)


def test_circle_finder_matches_a_brute_force_reachability():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": {"e"}, "e": {"d"}, "f": {"a"}}

    def reach(v: str) -> set[str]:
        seen, todo = set(), [v]
        while todo:
            for w in graph.get(todo.pop(), ()):
                if w not in seen:
                    seen.add(w)
                    todo.append(w)
        return seen

    slow = {tuple(sorted({v} | {w for w in reach(v) if v in reach(w)})) for v in graph if v in reach(v)}
    assert import_circles(graph) == sorted(slow) == [("a", "b", "c"), ("d", "e")]


def test_import_graph_follows_lazy_imports_of_submodules(monkeypatch, tmp_path):
    sources = {"server": "def f():\n    from sao_megatron.rollout.engine import routes\n",
               "routes": "from sao_megatron.rollout.engine.server import json_body\n"}
    files = [LIB / "rollout" / "engine" / f"{n}.py" for n in sources]
    monkeypatch.setattr(pathlib.Path, "read_text", lambda self, *a, **k: sources[self.stem])
    assert import_circles(import_graph(files)) == [("sao_megatron.rollout.engine.routes",
                                                    "sao_megatron.rollout.engine.server")]


# ---------------------------------------------------------------- 9. the repository is self-contained

# Built from pieces so that this file does not match itself.
OUTSIDE_REFERENCES = ("../" + "shared", "steering" + " repo", "DESIGN" + ".md", "STYLE" + ".md")


def tracked_files() -> list[pathlib.Path]:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, timeout=60)
    assert out.returncode == 0, f"the tests need a git checkout: {out.stderr.decode()}"
    return [ROOT / name for name in out.stdout.decode().split("\0") if name]


def outside_references(files: list[pathlib.Path]) -> list[str]:
    bad = []
    for path in files:
        if not path.is_file():
            continue  # deleted in the working tree, not yet in the index
        for line_no, line in enumerate(path.read_bytes().decode("utf-8", "replace").splitlines(), 1):
            bad += [f"{rel(path)}:{line_no} mentions {ref!r}" for ref in OUTSIDE_REFERENCES if ref in line]
    return bad


def test_no_tracked_file_refers_outside_the_repository():
    """Design and rules live in docs/ (architecture.md, contributing.md): a clone alone has them."""
    bad = outside_references(tracked_files())
    assert not bad, "point these at docs/architecture.md or docs/contributing.md instead:\n" + "\n".join(bad)


def test_outside_reference_check_catches_a_comment(monkeypatch):
    probe = LIB / "models" / "__ref_probe__.py"
    source = ("x = 1\n" + "y = 2  # see " + "DESIGN" + ".md section 1\n").encode()
    monkeypatch.setattr(pathlib.Path, "is_file", lambda self: True)
    monkeypatch.setattr(pathlib.Path, "read_bytes", lambda self: source)
    assert outside_references([probe]) == [f"{rel(probe)}:2 mentions {OUTSIDE_REFERENCES[2]!r}"]


# ---------------------------------------------------------------- 10. references into docs/ resolve

DOC_REFERENCE = re.compile(r"(?<![\w/.-])(docs/[\w.-]+\.md)(?:#([\w-]+))?")
MD_LINK = re.compile(r"\]\((?!\w+://)([^)\s#]*)(?:#([\w-]+))?\)")


def heading_anchors(text: str) -> set[str]:
    """GitHub's anchors of a Markdown file's headings (outside code fences)."""
    out, fenced = set(), False
    for line in text.splitlines():
        fenced ^= line.startswith("```")
        if not fenced and re.match(r"#{1,6} ", line):
            out.add(re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-"))
    return out


def broken_doc_references(files: list[pathlib.Path]) -> list[str]:
    """References to ``docs/<page>.md#<anchor>`` in any file, and relative links of Markdown files,
    that lead nowhere."""
    bad = []
    for path in files:
        if not path.is_file() or path.suffix in {".png", ".jpg", ".ipynb"}:
            continue
        text = path.read_bytes().decode("utf-8", "replace")
        refs = [(ROOT / m[1], m[2]) for m in DOC_REFERENCE.finditer(text)]
        if path.suffix == ".md":
            refs += [((path.parent / m[1]) if m[1] else path, m[2]) for m in MD_LINK.finditer(text)]
        for target, anchor in refs:
            if not target.exists():
                bad.append(f"{rel(path)}: {rel(target.resolve())} does not exist")
            elif anchor and target.suffix == ".md" and anchor not in heading_anchors(target.read_text()):
                bad.append(f"{rel(path)}: {rel(target.resolve())} has no heading #{anchor}")
    return bad


def test_references_into_docs_resolve():
    bad = broken_doc_references(tracked_files())
    assert not bad, "references to pages or sections that do not exist:\n" + "\n".join(bad)


def test_doc_reference_check_catches_a_missing_section(monkeypatch):
    probe = LIB / "algorithms" / "__doc_probe__.py"
    source = b"# GAE: docs/architecture.md#skip-observation-gae; DIS: docs/architecture.md#" + b"no-such-section\n"
    monkeypatch.setattr(pathlib.Path, "read_bytes", lambda self: source)
    monkeypatch.setattr(pathlib.Path, "is_file", lambda self: True)
    assert broken_doc_references([probe]) == [f"{rel(probe)}: docs/architecture.md has no heading #no-such-section"]
