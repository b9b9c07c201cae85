"""Does a router stop choosing a killed worker? sglang-router 0.3.2 vs the SGLang Model Gateway (smg).

Two fake engines (tests/component/fake_engine.py, real processes) behind the router; requests go
through it one after another (~20/s); one worker is SIGKILLed; the script prints, per policy, how many
requests failed after the kill, how long the router kept choosing the dead worker, and whether the
worker API removes and re-adds a worker (the restart path of ``rollout.supervisor``).

    python benchmarks/router_dead_worker.py --router "python -m sglang_router.launch_router"
    python benchmarks/router_dead_worker.py --router "/tmp/smg-venv/bin/smg launch"
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import quote

import httpx

HERE = Path(__file__).resolve().parent
FAKE = HERE.parent / "tests" / "component" / "fake_engine.py"


def start_engine(tmp: Path, name: str) -> tuple[subprocess.Popen, str]:
    port_file = tmp / f"{name}.port"
    proc = subprocess.Popen([sys.executable, str(FAKE), str(port_file)], start_new_session=True)
    for _ in range(200):
        if port_file.exists():
            return proc, f"http://127.0.0.1:{port_file.read_text()}"
        time.sleep(0.05)
    raise TimeoutError(name)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_router(cmd: str, urls: list[str], policy: str, tmp: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    argv = [*shlex.split(cmd), "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *urls,
            "--policy", policy, "--disable-retries", "--health-check-interval-secs", "1",
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()), "--log-level", "warn"]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", NO_PROXY="127.0.0.1")
    log = open(tmp / f"router-{policy}.log", "w")
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 60
    with httpx.Client(trust_env=False, timeout=2) as http:
        while time.time() < deadline:
            try:
                if http.get(url + "/health").status_code == 200 and ok_count(http, url, 4) == 4:
                    return proc, url
            except httpx.HTTPError:
                pass
            if proc.poll() is not None:
                raise RuntimeError((tmp / f"router-{policy}.log").read_text()[-2000:])
            time.sleep(0.3)
    raise TimeoutError("router did not come up")


def generate(http: httpx.Client, url: str, i: int) -> int | None:
    """The port that served request ``i`` (None: failed)."""
    try:
        r = http.post(url + "/generate", json={"input_ids": [1, 2, 3, i % 7], "rid": f"r{i}-{time.time()}",
                                               "sampling_params": {"max_new_tokens": 1}}, timeout=5)
        return r.json()["meta_info"]["served_by"] if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError, KeyError):
        return None


def ok_count(http, url, n) -> int:
    return sum(generate(http, url, i) is not None for i in range(n))


def worker_api(http: httpx.Client, router: str, worker: str) -> str:
    """Which remove/add calls the router accepts, and whether the listing follows."""
    out = []
    for name, call in (("DELETE /workers/{url}", lambda: http.delete(router + "/workers/" + quote(worker, safe=""))),
                       ("POST /remove_worker?url=",
                        lambda: http.post(router + "/remove_worker", params={"url": worker}))):
        r = call()
        out.append(f"{name}: HTTP {r.status_code}")
        if r.status_code < 300:
            break
    time.sleep(1.0)
    listed = http.get(router + "/workers").text
    out.append(f"listed after remove: {worker in listed}")
    for name, call in (("POST /workers", lambda: http.post(router + "/workers", json={"url": worker})),
                       ("POST /add_worker?url=", lambda: http.post(router + "/add_worker", params={"url": worker}))):
        r = call()
        out.append(f"{name}: HTTP {r.status_code} {r.text[:80]!r}")
        if r.status_code < 300:
            break
    time.sleep(2.0)
    out.append(f"listed after add: {worker in http.get(router + '/workers').text}")
    return "; ".join(out)


def measure(cmd: str, policy: str) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="router-dead-"))
    (e0, u0), (e1, u1) = start_engine(tmp, "e0"), start_engine(tmp, "e1")
    router, rurl = start_router(cmd, [u0, u1], policy, tmp)
    try:
        with httpx.Client(trust_env=False) as http:
            before = [generate(http, rurl, i) for i in range(20)]
            # The victim is the worker the router prefers (cache_aware pins similar prompts to one).
            if before.count(int(u0.rsplit(":", 1)[1])) > before.count(int(u1.rsplit(":", 1)[1])):
                (e0, u0), (e1, u1) = (e1, u1), (e0, u0)
            dead_port = int(u1.rsplit(":", 1)[1])
            os.killpg(e1.pid, signal.SIGKILL)
            e1.wait()
            t_kill, fails, last_fail = time.time(), 0, None
            total = 0
            while time.time() - t_kill < 20:
                total += 1
                if generate(http, rurl, total) is None:
                    fails, last_fail = fails + 1, time.time() - t_kill
                time.sleep(0.05)
            e1b, u1b = start_engine(tmp, "e1b")
            api = worker_api(http, rurl, u1)
            api2 = worker_api(http, rurl, u1b)
            after = [generate(http, rurl, i) for i in range(20)]
            e1b_port = int(u1b.rsplit(":", 1)[1])
            print(f"{cmd} policy={policy}: before kill {before.count(dead_port)}/20 to the victim; after the kill "
                  f"{fails}/{total} requests failed, the last {None if last_fail is None else round(last_fail, 1)} s "
                  f"after the kill; restarted worker served {after.count(e1b_port)}/20 after re-add\n"
                  f"  worker API (dead url): {api}\n  worker API (new url): {api2}", flush=True)
            e1b.kill()
    finally:
        for p in (router, e0):
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--router", required=True, help="router launch command (before its flags)")
    p.add_argument("--policies", default="round_robin,cache_aware")
    args = p.parse_args()
    for policy in args.policies.split(","):
        measure(args.router, policy)


if __name__ == "__main__":
    main()
