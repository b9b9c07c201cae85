"""Install what a GPU node lacks for scripts/gpu_check.sh, from a folder of wheels, without network.

    python gpu_env.py --target DIR [--wheels WHEELS] [--requirements scripts/gpu_requirements.txt]

Reads the pinned list (see gpu_requirements.txt): a distribution marked ``# keep`` is left alone
when the node has any version of it; the others must be at exactly the pinned version. What is
missing goes into DIR with ``pip install --no-index --find-links WHEELS --no-deps --target DIR``
(no virtual environment needed, and pip never resolves torch: the node's CUDA torch stays the one
imported). DIR is put first on PYTHONPATH by gpu_check.sh. Exit 0 when nothing is missing after
the install; 2 with the list of what is missing and how to get it otherwise. Standard library only:
it runs before anything is installed.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import pathlib
import re
import subprocess
import sys

REQUIREMENTS = pathlib.Path(__file__).resolve().parent / "gpu_requirements.txt"


def parse_requirements(text: str, *, drop_tags: set[str] = frozenset({"optional"})) -> list[tuple[str, str, bool]]:
    """``[(name, version, keep)]`` from ``name==version  # keep [tags]`` lines; comments and blanks
    skipped, and lines tagged with any of ``drop_tags`` ('optional' always: the check never needs
    them; 'te' with --no-te)."""
    out = []
    for line in text.splitlines():
        spec, _, comment = line.partition("#")
        spec = spec.strip()
        if not spec:
            continue
        match = re.fullmatch(r"([A-Za-z0-9_.\-]+)==([^\s;]+)", spec)
        if match is None:
            raise ValueError(f"gpu requirements line {line!r}: expected 'name==version [# keep]'")
        tags = set(comment.split())
        if tags & drop_tags:
            continue
        out.append((match.group(1), match.group(2), "keep" in tags))
    return out


def installed_version(name: str, path: list[str]) -> str | None:
    """The version of distribution ``name`` visible on ``path`` (first match, as import would find it)."""
    dists = md.distributions(name=name, path=path)
    for dist in dists:
        return dist.version
    return None


def missing(reqs: list[tuple[str, str, bool]], path: list[str]) -> list[str]:
    """``name==version`` for each requirement the interpreter on ``path`` does not satisfy."""
    out = []
    for name, version, keep in reqs:
        have = installed_version(name, path)
        if have is None or (not keep and have != version):
            out.append(f"{name}=={version}")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", required=True, help="install directory (put first on PYTHONPATH)")
    parser.add_argument("--wheels", default=None, help="folder made by scripts/gpu_wheels.sh")
    parser.add_argument("--requirements", default=str(REQUIREMENTS))
    parser.add_argument("--no-te", action="store_true", help="Transformer Engine not required (gpu_check --no-te)")
    args = parser.parse_args(argv)
    drop = {"optional", "te"} if args.no_te else {"optional"}
    reqs = parse_requirements(pathlib.Path(args.requirements).read_text(), drop_tags=drop)
    path = [args.target, *sys.path]
    todo = missing(reqs, path)
    if todo and args.wheels is None:
        print("missing on this node: " + " ".join(todo) + "\nprepare wheels on a machine with network "
              "(bash scripts/gpu_wheels.sh DIR), copy DIR here and pass --wheels DIR", file=sys.stderr)
        return 2
    if todo:
        print(f"installing {len(todo)} wheels into {args.target}: {' '.join(todo)}", flush=True)
        cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-index",
               "--find-links", args.wheels, "--no-deps", "--upgrade", "--target", args.target, *todo]
        proc = subprocess.run(cmd)
        if proc.returncode != 0:
            print(f"pip could not install from {args.wheels} (rc={proc.returncode}): were the wheels made for "
                  f"this node's Python {sys.version_info.major}.{sys.version_info.minor} and CPU "
                  "architecture? (bash scripts/gpu_wheels.sh --help)", file=sys.stderr)
            return 2
    still = missing(reqs, path)
    if still:
        print("still missing after the install: " + " ".join(still), file=sys.stderr)
        return 2
    print(f"python environment ready ({len(reqs)} requirements, {len(todo)} installed into {args.target})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
