"""``data.options.sandbox: isolated | unsafe``: what a non-root trainer gets, with and without user namespaces.

The code task runs as a non-root user (``unprivileged.py``): once as is (user namespaces work
here, so ``isolated`` resolves to ``userns``), once inside a user namespace whose
``user.max_user_namespaces`` is 0 (a cluster that disables them), where ``isolated`` must refuse
to start and ``unsafe`` must fall back to the audit hook with a warning. Each run scores the
shipped sample's reference solution (1.0) and an empty answer (0.0) in the mode it resolved.
"""

from __future__ import annotations

import json
import logging

import pytest
from unprivileged import REPO, TEST_UID, processes_of, run_unprivileged

from sao_megatron.config.schema import DataConfig
from sao_megatron.envs import CharTokenizer, CodeTask

pytestmark = pytest.mark.component
CODE_SAMPLE = REPO / "examples" / "data" / "code_sample.jsonl"

TASK = r'''
import json, logging, sys
from sao_megatron.config.schema import DataConfig
from sao_megatron.envs import CharTokenizer, CodeTask
from sao_megatron.envs.sandbox import SandboxUnavailableError
logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="LOG %(levelname)s %(message)s")
report = {}
for policy in ("isolated", "unsafe"):
    try:
        task = CodeTask(DataConfig(task="code", path=SAMPLE, max_prompt_tokens=256, reward_timeout_s=30.0,
                                   options={"sandbox": policy}), CharTokenizer())
    except SandboxUnavailableError as exc:
        report[policy] = {"error": str(exc)}
        continue
    p = task.prompts()[0]
    demo = task.demonstration(p)
    fn, args = task.reward_call(p, demo, [1] * len(demo), "")
    empty_fn, empty_args = task.reward_call(p, [], [], "")
    report[policy] = {"mode": task.isolation, "reward": fn(*args)[0], "empty": empty_fn(*empty_args)[0]}
print("REPORT " + json.dumps(report))
'''

# Disables user namespaces below this process (as a cluster's sysctl would), then runs TASK.
NO_USERNS = r'''
import os, sys
uid, gid = os.getuid(), os.getgid()
os.unshare(os.CLONE_NEWUSER)
open("/proc/self/setgroups", "w").write("deny")
open("/proc/self/uid_map", "w").write(f"{uid} {uid} 1\n")
open("/proc/self/gid_map", "w").write(f"{gid} {gid} 1\n")
open("/proc/sys/user/max_user_namespaces", "w").write("0")
os.execv(sys.executable, [sys.executable, "-c", TASK])  # a non-zero uid: exec drops the capabilities
'''


def _run(script: str) -> tuple[dict, list[str]]:
    proc = run_unprivileged(script, timeout_s=180)
    lines = proc.stdout.splitlines()
    report = next((x for x in lines if x.startswith("REPORT ")), None)
    assert report is not None, f"rc {proc.returncode}: {proc.stdout[-2000:]} {proc.stderr[-3000:]}"
    assert processes_of(TEST_UID) == []
    return json.loads(report[len("REPORT "):]), [x for x in lines if x.startswith("LOG ")]


def test_non_root_code_task_runs_isolated_in_a_user_namespace():
    report, logs = _run(TASK.replace("SAMPLE", repr(str(CODE_SAMPLE))))
    assert report["isolated"] == {"mode": "userns", "reward": 1.0, "empty": 0.0}
    assert report["unsafe"] == {"mode": "userns", "reward": 1.0, "empty": 0.0}  # isolation wins when it works
    sandbox_lines = [x for x in logs if "code sandbox" in x]
    assert len(sandbox_lines) == 2 and all(x.startswith("LOG INFO") and "user-namespace" in x
                                           for x in sandbox_lines), logs


def test_without_user_namespaces_isolated_refuses_and_unsafe_warns():
    task = TASK.replace("SAMPLE", repr(str(CODE_SAMPLE)))
    report, logs = _run(NO_USERNS.replace("TASK", repr(task)))
    assert "no isolating sandbox" in report["isolated"]["error"]
    assert "data.options.sandbox=unsafe" in report["isolated"]["error"]
    assert report["unsafe"] == {"mode": "audit", "reward": 1.0, "empty": 0.0}
    sandbox_lines = [x for x in logs if "code sandbox" in x]
    assert len(sandbox_lines) == 1 and sandbox_lines[0].startswith("LOG WARNING"), logs
    assert "NO isolation" in sandbox_lines[0]


def test_invalid_sandbox_option_is_a_clear_error():
    for value, err in (("isolate", ValueError), (True, ValueError)):
        with pytest.raises(err, match="data.options.sandbox"):
            CodeTask(DataConfig(task="code", path=str(CODE_SAMPLE), max_prompt_tokens=256, reward_timeout_s=30.0,
                                options={"sandbox": value}), CharTokenizer())


def test_start_up_logs_the_mode_once(caplog):
    with caplog.at_level(logging.INFO, logger="sao_megatron.envs.sandbox"):
        task = CodeTask(DataConfig(task="code", path=str(CODE_SAMPLE), max_prompt_tokens=256,
                                   reward_timeout_s=30.0), CharTokenizer())
    lines = [r.getMessage() for r in caplog.records if "code sandbox" in r.getMessage()]
    assert len(lines) == 1 and task.isolation in ("namespace", "userns"), lines
    assert "data.options.sandbox=isolated" in lines[0]
