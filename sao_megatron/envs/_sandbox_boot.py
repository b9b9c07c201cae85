"""Sandbox bootstrap: isolate this process, drop privileges, then exec the interpreter on the task code.

Run as ``python -I -S _sandbox_boot.py '<json spec>'`` by ``sandbox.run_python`` (standalone: it
must not import the package). Two isolation levels:

- ``namespace`` (root, or wherever ``unshare`` is permitted): new network namespace (no interface
  but a downed loopback: nothing is reachable), new mount namespace whose root is a fresh tmpfs
  holding only read-only binds of the interpreter's prefix and the system library directories plus
  the task's working directory at ``/work`` (``chroot``); then privileges are dropped to
  ``nobody`` with no-new-privs, so the chroot cannot be escaped and nothing else on the host
  (``/etc``, ``/home``, ``/root``, other runs) exists for the code.
- ``audit`` (unprivileged fallback): the same rlimits and working directory, and a Python audit hook
  that refuses socket creation, opening files outside the working directory and the stdlib, and
  starting processes. Audit hooks stop ordinary Python code, not a determined attacker with
  ``ctypes``; use ``namespace`` for untrusted code.

In both, the task code runs under ``-I`` (isolated mode: no env vars, no user site) with the audit
hook installed first, and with CPU-time, address-space, file-size, open-files and process limits.
"""

import ctypes
import json
import os
import resource
import sys

_CLONE_NEWNS, _CLONE_NEWUTS, _CLONE_NEWIPC, _CLONE_NEWNET = 0x00020000, 0x04000000, 0x08000000, 0x40000000
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_REMOUNT, _MS_BIND, _MS_REC, _MS_PRIVATE = 1, 2, 4, 32, 4096, 16384, 1 << 18
_PR_SET_NO_NEW_PRIVS = 38
_NOBODY = 65534

# Runs inside the sandboxed interpreter before the task code (passed with -c).
ENTRY = r'''
import os, sys
_allowed = tuple(sys.argv[1].split(os.pathsep))
_mode = sys.argv[2]
def _hook(event, args):
    if event in ("socket.__new__", "socket.connect", "socket.bind", "socket.getaddrinfo"):
        raise PermissionError("sandbox: network access is disabled")
    if _mode == "audit":
        if event == "open" and isinstance(args[0], (str, bytes)):
            p = os.path.realpath(os.fsdecode(args[0]))
            if not p.startswith(_allowed):
                raise PermissionError(f"sandbox: {p} is outside the sandbox")
        if event in ("subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.fork", "ctypes.dlopen"):
            raise PermissionError(f"sandbox: {event} is disabled")
sys.addaudithook(_hook)
del _hook
sys.argv = ["main.py"]
import runpy
runpy.run_path("main.py", run_name="__main__")
'''


def _libc():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mount.argtypes = [ctypes.c_char_p] * 3 + [ctypes.c_ulong, ctypes.c_char_p]
    return libc


def _mount(libc, src, dst, fstype, flags, data=None):
    enc = lambda s: None if s is None else s.encode()  # noqa: E731
    if libc.mount(enc(src), enc(dst), enc(fstype), flags, enc(data)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {src} -> {dst}: {os.strerror(err)}")


def _bind_ro(libc, src, root):
    dst = root + src
    os.makedirs(dst, exist_ok=True)
    _mount(libc, src, dst, None, _MS_BIND | _MS_REC)
    _mount(libc, None, dst, None, _MS_BIND | _MS_REMOUNT | _MS_RDONLY | _MS_NOSUID | _MS_NODEV)


def _enter_namespace(spec):
    """New net+mount namespace, tmpfs root with read-only runtime binds, chroot to it."""
    os.unshare(_CLONE_NEWNS | _CLONE_NEWNET | _CLONE_NEWIPC | _CLONE_NEWUTS)
    libc = _libc()
    _mount(libc, None, "/", None, _MS_REC | _MS_PRIVATE)
    root, work = spec["root"], spec["work"]
    _mount(libc, "tmpfs", root, "tmpfs", _MS_NOSUID | _MS_NODEV, "size=4m,mode=0755")
    for d in ("/lib", "/lib64", "/usr/lib", "/usr/lib64", "/usr/lib32"):
        if os.path.islink(d):  # merged-/usr systems: /lib -> usr/lib
            os.makedirs(os.path.dirname(root + d), exist_ok=True)
            os.symlink(os.readlink(d), root + d)
        elif os.path.isdir(d):
            _bind_ro(libc, d, root)
    _bind_ro(libc, spec["prefix"], root)
    os.makedirs(root + "/work")
    _mount(libc, work, root + "/work", None, _MS_BIND | _MS_NOSUID | _MS_NODEV)
    os.makedirs(root + "/dev")
    open(root + "/dev/null", "w").close()
    _mount(libc, "/dev/null", root + "/dev/null", None, _MS_BIND)
    _mount(libc, None, root, None, _MS_BIND | _MS_REMOUNT | _MS_RDONLY | _MS_NOSUID | _MS_NODEV)
    os.chroot(root)
    os.chdir("/work")
    os.setgroups([])
    os.setgid(_NOBODY)
    os.setuid(_NOBODY)
    return "/work"


def _limit(spec):
    cpu, mem = int(spec["cpu_s"]), int(spec["memory_mb"]) << 20
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
    resource.setrlimit(resource.RLIMIT_FSIZE, (16 << 20, 16 << 20))
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if spec["mode"] == "namespace":  # per-uid count: only meaningful for the dedicated uid
        resource.setrlimit(resource.RLIMIT_NPROC, (64, 64))
    _libc().prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)


def main():
    spec = json.loads(sys.argv[1])
    exe, prefix = spec["exe"], spec["prefix"]
    if spec["mode"] == "namespace":
        work = _enter_namespace(spec)
    else:
        work = spec["work"]
        os.chdir(work)
    _limit(spec)
    allowed = os.pathsep.join([work + os.sep, prefix + os.sep])
    os.execve(exe, [exe, "-I", "-S", "-B", "-c", ENTRY, allowed, spec["mode"]], {"PATH": "/nonexistent"})


if __name__ == "__main__":
    main()
