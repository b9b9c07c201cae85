"""Sandbox bootstrap: isolate, then exec the interpreter on the task code.

Run as ``python -I -S _sandbox_boot.py '<json spec>'`` by ``sandbox.run_python`` (standalone: it
must not import the package). Isolation levels (``spec["mode"]``):

- ``namespace`` (root): new mount, network, PID, IPC and UTS namespaces; the root is a fresh tmpfs
  holding only read-only binds of the interpreter's prefix and the system library directories,
  ``/dev/null`` and the task's working directory at ``/work`` (``chroot``); the code runs as
  ``nobody`` with no-new-privs.
- ``userns`` (any user, where unprivileged user namespaces are enabled): the same, inside a new
  user namespace that maps only the caller's uid/gid (seen inside as 65534). The code keeps no
  capability (it execs as a non-zero uid), a chrooted process may not create user namespaces, so
  the chroot cannot be left; on the host it is the trainer's user, but it sees no host file, no
  host process (PID namespace) and no network.
- ``audit`` (no isolation: only with ``data.options.sandbox: unsafe``): the rlimits, the working
  directory and a Python audit hook refusing sockets, files outside the working directory and the
  stdlib, and process creation. Native code (``_posixsubprocess``, ``ctypes``) walks past it.

Process tree of the isolating modes: this process (host PID namespace, in the caller's process
group) forks the namespace's init (PID 1: trusted, waits, never exec's), which forks the task
(PID 2: limits, drop, exec). When PID 1 exits the kernel kills everything left in the namespace,
so daemonised or ``setsid`` children never outlive the run; init reports the task's wait status
through a pipe and this process exits the same way (same code, or killed by the same signal).
"""

import ctypes
import json
import os
import resource
import signal
import sys
import traceback

_CLONE_NEWNS, _CLONE_NEWUTS, _CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
_CLONE_NEWUSER, _CLONE_NEWPID, _CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_REMOUNT, _MS_BIND, _MS_REC, _MS_PRIVATE = 1, 2, 4, 32, 4096, 16384, 1 << 18
_PR_SET_PDEATHSIG, _PR_SET_DUMPABLE, _PR_SET_NO_NEW_PRIVS = 1, 4, 38
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


def _prctl(libc, option, value):
    if libc.prctl(option, ctypes.c_ulong(value), 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl({option}): {os.strerror(err)}")


def _bind_ro(libc, src, root):
    dst = root + src
    os.makedirs(dst, exist_ok=True)
    _mount(libc, src, dst, None, _MS_BIND | _MS_REC)
    # A user namespace may not clear the flags the host mount carries (noexec, ...): keep them.
    kept = os.statvfs(src).f_flag & (os.ST_NOEXEC | os.ST_NOATIME | os.ST_NODIRATIME)
    _mount(libc, None, dst, None, _MS_BIND | _MS_REMOUNT | _MS_RDONLY | _MS_NOSUID | _MS_NODEV | kept)


def _map_ids(uid, gid):
    """Map the caller's uid/gid (and only them) to 65534 inside the new user namespace."""
    with open("/proc/self/setgroups", "w") as f:  # required before an unprivileged gid_map
        f.write("deny")
    for name, outer in (("uid_map", uid), ("gid_map", gid)):
        with open(f"/proc/self/{name}", "w") as f:
            f.write(f"{_NOBODY} {outer} 1\n")


def _build_root(libc, spec):
    """Tmpfs root with read-only runtime binds and the working directory at /work; chroot to it."""
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


def _limit(spec):
    cpu, mem, nproc = int(spec["cpu_s"]), int(spec["memory_mb"]) << 20, int(spec["max_processes"])
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
    resource.setrlimit(resource.RLIMIT_FSIZE, (16 << 20, 16 << 20))
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    # Counted per uid and user namespace: meaningful for nobody (namespace) and a fresh user
    # namespace (userns); in audit mode it would count every process of the trainer's user.
    if spec["mode"] != "audit":
        resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))


def _exec_task(spec, work):
    exe = spec["exe"]
    allowed = os.pathsep.join([work + os.sep, spec["prefix"] + os.sep])
    os.execve(exe, [exe, "-I", "-S", "-B", "-c", ENTRY, allowed, spec["mode"]], {"PATH": "/nonexistent"})


def _task(libc, spec):
    """PID 2: drop to nobody (root mode), set limits and no-new-privs, exec the interpreter."""
    if spec["mode"] == "namespace":
        os.setgroups([])
        os.setgid(_NOBODY)
        os.setuid(_NOBODY)
    _limit(spec)
    _prctl(libc, _PR_SET_NO_NEW_PRIVS, 1)
    _exec_task(spec, "/work")


def _init(libc, spec, report_fd):
    """PID 1 of the new PID namespace: run the task, reap orphans, report the task's wait status."""
    _prctl(libc, _PR_SET_PDEATHSIG, signal.SIGKILL)  # the boot process died: take the namespace down
    _prctl(libc, _PR_SET_DUMPABLE, 0)  # the task (same uid in userns mode) may not ptrace PID 1
    pid = os.fork()
    if pid == 0:
        _child(_task, libc, spec)
    while True:
        done, status = os.wait()
        if done == pid:
            os.write(report_fd, str(status).encode())
            os._exit(0)  # returning kills the rest of the namespace


def _child(fn, *args):
    """Run ``fn`` in a forked child: it exec's or exits, never returns into the parent's code."""
    try:
        fn(*args)
    except BaseException:  # noqa: BLE001 - reported on stderr, the run fails with 127
        traceback.print_exc()
    finally:
        os._exit(127)


def _isolated(spec):
    libc = _libc()
    flags = _CLONE_NEWNS | _CLONE_NEWNET | _CLONE_NEWPID | _CLONE_NEWIPC | _CLONE_NEWUTS
    uid, gid = os.getuid(), os.getgid()
    os.unshare(flags | (_CLONE_NEWUSER if spec["mode"] == "userns" else 0))
    if spec["mode"] == "userns":
        _map_ids(uid, gid)
    _build_root(libc, spec)
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read_fd)
        _child(_init, libc, spec, write_fd)
    os.close(write_fd)
    report = os.read(read_fd, 64)
    os.waitpid(pid, 0)
    _exit_like(int(report) if report else 127 << 8)


def _exit_like(status):
    """Exit with the task's code, or die of the task's signal (the caller sees returncode -sig)."""
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
    os._exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else 127)


def main():
    spec = json.loads(sys.argv[1])
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # re-raising SIGXCPU here must not dump core
    if spec["mode"] == "audit":
        os.chdir(spec["work"])
        _limit(spec)
        _exec_task(spec, spec["work"])
    _isolated(spec)


if __name__ == "__main__":
    main()
