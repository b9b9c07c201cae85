"""The weight-update group inside a real torchrun worker, under torch ≤ 2.11's store rule.

The first GPU node (torch 2.11.0) hung in ``weight-sync``: under torchrun
(``TORCHELASTIC_USE_AGENT_STORE=True``) that torch makes every rank of a ``tcp://`` rendezvous a
client, so the trainer's end of the group waited for a store nobody served. torch 2.14, this
project's pin, serves it; ``mp_scripts/torch211_store.py`` puts the old rule back inside the worker.
One torchrun run (forked from the session's preloaded server, so only the worker pays its imports)
serves both tests.
"""

from __future__ import annotations

import json

import pytest
from megatron_launch import SCRIPTS, launch
from megatron_launch import _env as launch_env

from sao_megatron.parallel.launcher_env import child_env, is_launcher_variable

pytestmark = pytest.mark.component

TUNING_DEFAULTS = {"OMP_NUM_THREADS", "TORCH_NCCL_ASYNC_ERROR_HANDLING"}
"""What torchrun sets only where the user has not, kept for children (parallel/launcher_env.py)."""


@pytest.fixture(scope="module")
def torchrun_worker(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("update-group-torchrun") / "results.json"
    launch(["torch.distributed.run", "--standalone", "--nproc_per_node=1", str(SCRIPTS / "torch211_store.py"),
            str(SCRIPTS / "update_group_torchrun.py"), str(out)], module=True, timeout=300)
    return json.loads(out.read_text())


def test_update_group_forms_under_torchrun_with_torch_2_11_store_rule(torchrun_worker):
    r = torchrun_worker
    assert r["env"].get("TORCHELASTIC_USE_AGENT_STORE") == "True", "not a torchrun worker"
    # The old rule is in force: SGLang's way of hosting (a rank-0 tcp:// rendezvous) gets no server.
    assert r["control"] != "formed", "torch 2.11's store rule was not applied"
    # The trainer's end hosted its store all the same; the SGLang-style receiver got the broadcast.
    assert r["received"] == r["sent"] and r["receiver_exitcode"] == 0


def test_children_get_none_of_what_torchrun_sets(torchrun_worker):
    """Every variable torchrun gave the worker is a launcher variable, which ``child_env`` drops, or one
    of the documented tuning defaults: a torch that adds one fails here until it is classified."""
    env = torchrun_worker["env"]
    added = {k for k in env if k not in launch_env()}  # what the launch had, torchrun's additions aside
    assert {"RANK", "MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE"} <= added  # what the hang needs
    assert {k for k in added if not is_launcher_variable(k)} <= TUNING_DEFAULTS
    assert not set(child_env(env)) & (added - TUNING_DEFAULTS)
