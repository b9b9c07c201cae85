"""Start and stop local rollout processes: embedded engines and the real sglang-router.

Both bind to 127.0.0.1 only. Engines take ``--port 0`` and report the port the
OS gave them through a file (no port race); the router has no such option, so
it gets a port probed just before it starts (retried if it loses the race).
Every process gets its own session so ``stop()`` ends it and its children,
and nothing else.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import httpx

from sao_megatron.config.schema import RolloutConfig
from sao_megatron.net import free_port
from sao_megatron.parallel.launcher_env import child_env
from sao_megatron.rollout.health import headers_for, wait_healthy

logger = logging.getLogger(__name__)


def _offline_env() -> dict[str, str]:
    """The environment for child processes: not the trainer's launcher variables (an engine is no rank
    of the trainer's world), no hub downloads, no proxies for loopback traffic."""
    env = {k: v for k, v in child_env().items() if k.lower() not in ("http_proxy", "https_proxy", "all_proxy")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", NO_PROXY="127.0.0.1,localhost", no_proxy="127.0.0.1,localhost")
    return env


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL it when the process that started it dies.

    The children run in their own session (so ``stop()`` can end their whole group), which also
    shields them from the parent's terminal signals: without this, a trainer killed with SIGKILL
    (OOM, preemption) would leave engines running and holding ports and memory.
    """
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)


def _log_tail(path: Path, n: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


def _stop_process(proc: subprocess.Popen, timeout: float = 10.0) -> None:
    """SIGTERM the process group started for ``proc``, SIGKILL after ``timeout``."""
    if proc.poll() is not None:
        return
    for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


def _wait_http_ok(url: str, proc: subprocess.Popen, log: Path, deadline: float, what: str) -> None:
    """The local process ``proc`` serves ``url``'s /health, or RuntimeError/TimeoutError with its log tail."""
    wait_healthy([url], timeout_s=max(deadline - time.monotonic(), 0.0), what=what,
                 alive=lambda: proc.poll() is None,
                 on_dead=lambda: f"exit code {proc.poll()}; log {log}:\n{_log_tail(log)}")


class LocalEngines:
    """``num_engines`` embedded engines (``sao-megatron serve-local``) on free loopback ports.

    A context manager: ``with LocalEngines(d, 2) as engines: engines.urls``.
    """

    kind = "embedded"

    def __init__(self, model_dir: str | Path, num_engines: int, *, api_key: str | None = None,
                 extra_args: Sequence[str] = (), log_dir: str | Path | None = None, startup_timeout_s: float = 180.0):
        if num_engines < 1:
            raise ValueError(f"num_engines must be >= 1, got {num_engines}")
        self.model_dir = str(model_dir)
        self.num_engines = num_engines
        self.api_key = api_key
        self.extra_args = list(extra_args)
        self.log_dir = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix="sao-engines-"))
        self.startup_timeout_s = startup_timeout_s
        self.stop_timeout_s = 3.0
        self.processes: list[subprocess.Popen] = []
        self.urls: list[str] = []
        self.logs: list[Path] = []
        self._restarts: dict[int, int] = {}

    def _command(self, port_file: Path) -> list[str]:
        cmd = [sys.executable, "-m", "sao_megatron.cli", "--log-level", "WARNING", "serve-local",
               "--model-dir", self.model_dir, "--port", "0", "--port-file", str(port_file), "--skip-tokenizer-init"]
        if self.api_key:
            cmd += ["--api-key", self.api_key]
        return cmd + self.extra_args

    def _env(self) -> dict[str, str]:
        return _offline_env()

    def _spawn(self, name: str) -> tuple[subprocess.Popen, Path, Path]:
        port_file, log = self.log_dir / f"{name}.port", self.log_dir / f"{name}.log"
        port_file.unlink(missing_ok=True)
        with open(log, "w") as fh:
            proc = subprocess.Popen(self._command(port_file), stdout=fh, stderr=subprocess.STDOUT,
                                    env=self._env(), start_new_session=True, preexec_fn=_die_with_parent)
        return proc, port_file, log

    def start(self) -> list[str]:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        port_files = []
        try:
            for i in range(self.num_engines):
                proc, port_file, log = self._spawn(f"engine{i}")
                self.processes.append(proc)
                port_files.append(port_file)
                self.logs.append(log)
            deadline = time.monotonic() + self.startup_timeout_s
            for proc, port_file, log in zip(self.processes, port_files, self.logs):
                url = f"http://127.0.0.1:{self._wait_port(proc, port_file, log, deadline)}"
                _wait_http_ok(url, proc, log, deadline, f"engine {url}")
                self.urls.append(url)
        except BaseException:
            self.stop()
            raise
        logger.info("started %d %s engines: %s", self.num_engines, self.kind, self.urls)
        return self.urls

    @staticmethod
    def _wait_port(proc: subprocess.Popen, port_file: Path, log: Path, deadline: float) -> int:
        while time.monotonic() < deadline:
            if port_file.exists():
                return int(port_file.read_text())
            if proc.poll() is not None:
                raise RuntimeError(f"engine exited with code {proc.returncode} during startup; log {log}:\n"
                                   f"{_log_tail(log)}")
            time.sleep(0.1)
        raise TimeoutError(f"engine did not bind a port in time; log {log}:\n{_log_tail(log)}")

    def alive(self, index: int) -> bool:
        return self.processes[index].poll() is None

    def restart(self, index: int, *, model_dir: str | Path | None = None, extra_args: Sequence[str] | None = None) -> str:
        """Kill engine ``index`` (SIGKILL to its group: also ends a stopped/hung one) and start it again on
        a new port, from ``model_dir`` with ``extra_args`` when given (e.g. the current weights and their
        ``--weight-version``); blocks until it answers /health and returns its new URL
        (RuntimeError/TimeoutError with the log tail)."""
        self.kill(index)
        if model_dir is not None:
            self.model_dir = str(model_dir)
        if extra_args is not None:
            self.extra_args = list(extra_args)
        self._restarts[index] = self._restarts.get(index, 0) + 1
        proc, port_file, log = self._spawn(f"engine{index}.restart{self._restarts[index]}")
        self.processes[index], self.logs[index] = proc, log
        try:
            deadline = time.monotonic() + self.startup_timeout_s
            url = f"http://127.0.0.1:{self._wait_port(proc, port_file, log, deadline)}"
            _wait_http_ok(url, proc, log, deadline, f"engine {url}")
        except BaseException:
            _stop_process(proc, timeout=3.0)
            raise
        logger.info("engine %d restarted at %s (was %s)", index, url, self.urls[index])
        self.urls[index] = url
        return url

    def kill(self, index: int) -> None:
        """SIGKILL one engine at once (failure tests)."""
        proc = self.processes[index]
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(10)

    def stop(self) -> None:
        # Engines hold no state worth a graceful drain: do not let shutdown dominate a requeue.
        for proc in self.processes:
            _stop_process(proc, timeout=self.stop_timeout_s)

    def __enter__(self) -> LocalEngines:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class SGLangEngines(LocalEngines):
    """``num_engines`` real SGLang servers (``python -m sglang.launch_server``) on free loopback ports.

    The same life cycle as :class:`LocalEngines` (``extra_args`` such as ``--weight-version``,
    ``--skip-tokenizer-init`` and ``--enable-return-routed-experts`` mean the same to both), run by
    ``python``: SGLang's own venv (:func:`sglang_python`). The KV cache holds ``max_total_tokens``
    (SGLang otherwise sizes it to the free memory: 58M tokens, 13.8 GB on a CPU machine). The dtype
    is the checkpoint's own (its config.json), passed explicitly: SGLang's ``auto`` serves a float32
    checkpoint in float16. ``device="cpu"`` runs it with the CPU support of
    ``rollout.sglang_cpu``; ``"cuda"`` runs it plainly.

    SGLang has no port file: each start takes a port probed just before (the log says if it lost the
    race, which ends the start with that log's tail).
    """

    kind = "SGLang"

    def __init__(self, model_dir: str | Path, num_engines: int, *, python: str, device: str,
                 max_total_tokens: int, api_key: str | None = None, extra_args: Sequence[str] = (),
                 log_dir: str | Path | None = None, startup_timeout_s: float = 300.0):
        if device not in ("cpu", "cuda"):
            raise ValueError(f"device must be cpu or cuda, got {device!r}")
        if max_total_tokens < 0:
            raise ValueError(f"max_total_tokens must be >= 0 (0: SGLang's own sizing), got {max_total_tokens}")
        super().__init__(model_dir, num_engines, api_key=api_key, extra_args=extra_args, log_dir=log_dir,
                         startup_timeout_s=startup_timeout_s)
        self.python, self.device, self.max_total_tokens = python, device, max_total_tokens
        self.stop_timeout_s = 15.0  # SGLang takes 3-12 s to shut down on SIGTERM
        self.disabled_patches: tuple[str, ...] = ()
        """CPU patches left out (tests show each is needed): names of ``sglang_cpu.PATCHES``."""

    def _command(self, port_file: Path) -> list[str]:
        port = free_port()
        port_file.write_text(str(port))
        cmd = [self.python, "-m", "sglang.launch_server", "--model-path", self.model_dir,
               "--host", "127.0.0.1", "--port", str(port),
               *sglang_server_args(self.model_dir, max_total_tokens=self.max_total_tokens, device=self.device)]
        if self.api_key:
            cmd += ["--api-key", self.api_key]
        if "--weight-version" not in self.extra_args:
            cmd += ["--weight-version", "0"]
        return cmd + self.extra_args

    def _env(self) -> dict[str, str]:
        if self.device != "cpu":
            return _offline_env()
        from sao_megatron.rollout import sglang_cpu

        return sglang_cpu.cpu_env(_offline_env(), disable=self.disabled_patches)


def sglang_server_args(model_dir: str | Path, *, max_total_tokens: int, device: str) -> list[str]:
    """What every SGLang server sao-megatron starts gets: the checkpoint's dtype, the KV size, no
    warm-up request (it would run before the trainer's weights are loaded anyway), and on CPU the
    device (SGLang then picks torch-native attention and sampling itself)."""
    args = ["--dtype", checkpoint_dtype(model_dir), "--skip-server-warmup"]
    if max_total_tokens:
        args += ["--max-total-tokens", str(max_total_tokens)]
    return args + (["--device", "cpu"] if device == "cpu" else [])


def local_sglang_engines(rollout: RolloutConfig, model_dir: str | Path, *, log_dir: str | Path, extra_args: Sequence[str],
                         device: str | None = None) -> SGLangEngines:
    """``rollout.num_engines`` SGLang servers from a RolloutConfig (engine=sglang without engine_urls);
    not started yet. ValueError saying how to build SGLang's venv when its python is missing."""
    return SGLangEngines(model_dir, rollout.num_engines, python=sglang_python(rollout.sglang_python),
                         device=device or default_device(), max_total_tokens=rollout.sglang_max_total_tokens,
                         api_key=rollout.api_key, extra_args=extra_args, log_dir=log_dir,
                         startup_timeout_s=max(rollout.startup_timeout_s, 300.0))


def checkpoint_dtype(model_dir: str | Path) -> str:
    """The dtype an HF checkpoint declares (config.json ``torch_dtype``/``dtype``), as SGLang's --dtype."""
    import json

    config = json.loads((Path(model_dir) / "config.json").read_text())
    name = str(config.get("torch_dtype") or config.get("dtype") or "").removeprefix("torch.")
    if name not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"{model_dir}/config.json declares dtype {name or 'none'!r}; SGLang servers started "
                         "here need float32, bfloat16 or float16 (torch_dtype) to serve the trainer's dtype")
    return name


SGLANG_ENV_HELP = ("build it with `bash scripts/setup.sh --sglang` (or `make sglang-env`), which prints its "
                   "python on the last line, and pass --set rollout.sglang_python=THAT_PATH (or export "
                   "SAO_SGLANG_PYTHON=THAT_PATH)")


def sglang_python(configured: str | None) -> str:
    """The python of SGLang's venv: ``configured`` (rollout.sglang_python), else ``$SAO_SGLANG_PYTHON``.

    ValueError saying how to build it when neither is set, the file is missing, or its sglang is not
    the pinned release."""
    from sao_megatron.rollout.sglang_cpu import SGLANG_VERSION

    python = configured or os.environ.get("SAO_SGLANG_PYTHON")
    if not python:
        raise ValueError("rollout.engine=sglang without rollout.engine_urls starts SGLang servers on this "
                         f"machine and needs the python of an SGLang {SGLANG_VERSION} venv: {SGLANG_ENV_HELP}")
    if not os.access(python, os.X_OK):
        raise ValueError(f"rollout.sglang_python={python} is not an executable file: {SGLANG_ENV_HELP}")
    probe = subprocess.run([python, "-c", "import importlib.metadata as m; print(m.version('sglang'))"],
                           capture_output=True, text=True, timeout=60, env=_offline_env())
    have = probe.stdout.strip() if probe.returncode == 0 else "not installed"
    if have != SGLANG_VERSION:
        raise ValueError(f"{python} has sglang {have}, the project is pinned to sglang=={SGLANG_VERSION}: "
                         f"{SGLANG_ENV_HELP}")
    return python


def default_device() -> str:
    """Where locally started SGLang servers run: cuda when this machine has a GPU, else cpu."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


class SGLangRouterProcess:
    """The real sglang-router (PyPI ``sglang-router``) on 127.0.0.1 in front of ``worker_urls``.

    It must never reach the network: pass ``tokenizer_path`` (a local directory) or let
    the workers report a local path in ``/model_info`` (the embedded engine does); the
    hub is disabled in its environment either way.
    """

    def __init__(self, worker_urls: Sequence[str], *, policy: str = "round_robin", api_key: str | None = None,
                 tokenizer_path: str | None = None, log_dir: str | Path | None = None,
                 startup_timeout_s: float = 60.0, request_timeout_s: int = 1800, extra_args: Sequence[str] = ()):
        self.worker_urls = list(worker_urls)
        self.policy = policy
        self.api_key = api_key
        self.tokenizer_path = tokenizer_path
        self.log_dir = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix="sao-router-"))
        self.startup_timeout_s = startup_timeout_s
        self.request_timeout_s = request_timeout_s
        self.extra_args = list(extra_args)
        self.process: subprocess.Popen | None = None
        self.url = ""

    def _command(self, port: int) -> list[str]:
        # Retries off: a generation that failed mid-way must surface, not silently run twice.
        cmd = [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
               "--worker-urls", *self.worker_urls, "--policy", self.policy, "--disable-retries",
               "--log-level", "warn", "--request-timeout-secs", str(self.request_timeout_s),
               "--health-check-interval-secs", "5", "--prometheus-host", "127.0.0.1",
               "--prometheus-port", str(free_port())]
        if self.api_key:
            cmd += ["--api-key", self.api_key]
        if self.tokenizer_path:
            cmd += ["--tokenizer-path", self.tokenizer_path]
        return cmd + self.extra_args

    def start(self) -> str:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log = self.log_dir / "router.log"
        for attempt in range(3):
            port = free_port()
            with open(log, "w") as fh:
                self.process = subprocess.Popen(self._command(port), stdout=fh, stderr=subprocess.STDOUT,
                                                env=_offline_env(), start_new_session=True,
                                                preexec_fn=_die_with_parent)
            url = f"http://127.0.0.1:{port}"
            try:
                _wait_http_ok(url, self.process, log, time.monotonic() + self.startup_timeout_s,
                              "sglang-router")
                self._wait_workers(url, log)
            except RuntimeError:
                self.stop()
                if attempt == 2:
                    raise
                continue
            except BaseException:
                self.stop()
                raise
            self.url = url
            return url
        raise AssertionError("unreachable")

    def _wait_workers(self, url: str, log: Path) -> None:
        """Until the router lists every worker as healthy."""
        deadline = time.monotonic() + self.startup_timeout_s
        with httpx.Client(trust_env=False, timeout=2.0, headers=headers_for(self.api_key)) as http:
            while time.monotonic() < deadline:
                try:
                    workers = http.get(url + "/workers").json().get("workers", [])
                    healthy = {w["url"].rstrip("/") for w in workers if w.get("is_healthy")}
                    if healthy >= {u.rstrip("/") for u in self.worker_urls}:
                        return
                except (httpx.HTTPError, ValueError, KeyError, AttributeError):
                    pass
                time.sleep(0.2)
        raise TimeoutError(f"sglang-router did not register {self.worker_urls}; log {log}:\n{_log_tail(log)}")

    def stop(self) -> None:
        if self.process is not None:
            _stop_process(self.process)

    def __enter__(self) -> SGLangRouterProcess:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
