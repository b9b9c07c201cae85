"""Pure logic of the Slurm launcher: ports, engine layout, commands, overrides, plan checks."""

from __future__ import annotations

import itertools
import pathlib
import subprocess

import pytest

from sao_megatron.config import ExperimentConfig, apply_overrides, from_dict
from sao_megatron import net
from sao_megatron.launch import layout as lp
from sao_megatron.launch.cli import parse_time_min
from sao_megatron.launch.layout import LaunchPlan

pytestmark = pytest.mark.unit


def make_plan(**kw) -> LaunchPlan:
    return LaunchPlan(**{"config": "/cfg/x.yaml", "run_dir": "/runs/x", **kw})


def reference_blocks(ephemeral: tuple[int, int]) -> list[int]:
    """Walk the ports one by one and cut a block from every run of PORTS_PER_JOB free ones."""
    low, high = ephemeral
    blocks, run = [], []
    for port in range(net.PORT_RANGE_START, 65536):
        if low <= port <= high:
            run = []
            continue
        run.append(port)
        if len(run) == net.PORTS_PER_JOB:
            blocks.append(run[0])
            run = []
    return blocks


@pytest.mark.parametrize("ephemeral", [(32768, 60999), (49152, 65535), (10000, 30000), (1024, 20001),
                                       (40000, 40000), (61001, 61100)])
def test_port_blocks_avoid_the_ephemeral_range(ephemeral):
    blocks = net.port_blocks(ephemeral)
    assert blocks == reference_blocks(ephemeral)
    low, high = ephemeral
    for b in blocks:  # every port of every block is a server port outside the kernel's client range
        assert net.PORT_RANGE_START <= b and b + net.PORTS_PER_JOB <= 65536
        assert b + net.PORTS_PER_JOB - 1 < low or b > high
    assert all(b - a >= net.PORTS_PER_JOB for a, b in itertools.pairwise(blocks))  # disjoint


def test_linux_default_range_leaves_85_blocks_on_both_sides():
    blocks = net.port_blocks((32768, 60999))
    assert len(blocks) == 85 and blocks[0] == 20000 and blocks[62] == 32400 and blocks[63] == 61000
    assert blocks[-1] == 65200


def test_port_base_is_stable_and_differs_for_consecutive_jobs():
    ephemeral = (32768, 60999)
    n = len(net.port_blocks(ephemeral))
    bases = {j: net.port_base(j, ephemeral) for j in range(15591800, 15591800 + 2 * n)}
    for j, b in bases.items():
        assert net.port_base(j, ephemeral) == b  # a requeued job gets the same block
        assert b in net.port_blocks(ephemeral)
    for a, b in itertools.pairwise(sorted(bases)[:n]):  # n consecutive job ids never share a port
        assert abs(bases[a] - bases[b]) >= net.PORTS_PER_JOB


@pytest.mark.parametrize("ephemeral", [(1024, 65535), (20000, 65535), (19000, 65400)])
def test_no_room_outside_the_ephemeral_range_is_a_clear_error(ephemeral):
    with pytest.raises(ValueError, match=r"ip_local_port_range.*sysctl -w"):
        net.port_base(1, ephemeral)


def test_engine_endpoints_match_nested_loop_reference():
    addrs = ["10.0.0.5", "10.0.0.6", "10.0.0.7"]
    got = lp.engine_endpoints(addrs, 30000, per_node=4)
    ref = []
    port = 30000
    for addr in addrs:
        for _ in range(4):
            ref.append((addr, port))
            port += 1
    assert got == ref
    # emulated nodes share one address: every engine still needs its own port
    same = lp.engine_endpoints(["127.0.0.1"] * 3, 30000, per_node=2)
    assert len({p for _, p in same}) == 6
    assert max(p for _, p in same) < 30000 + net.MASTER_PORT_OFFSET


@pytest.mark.parametrize("kw,expected", [
    (dict(nodes_rollout=2), 1),                                   # CPU: one embedded engine per node
    (dict(nodes_rollout=1, gpus_per_node=8), 1),                  # one TP=8 server
    (dict(nodes_rollout=1, gpus_per_node=8, gpus_per_engine=2), 4),
    (dict(nodes_rollout=0, gpus_per_node=8), 0),
    (dict(nodes_rollout=1, gpus_per_node=8, server="embedded"), 1),
])
def test_engines_per_node(kw, expected):
    assert lp.engines_per_node(make_plan(**kw)) == expected


def test_router_only_with_several_engines_by_default():
    assert not lp.uses_router(make_plan(nodes_rollout=1))
    assert lp.uses_router(make_plan(nodes_rollout=2))
    assert lp.uses_router(make_plan(nodes_rollout=1, router="sglang_router"))
    assert not lp.uses_router(make_plan(nodes_rollout=3, router="none"))


@pytest.mark.parametrize("kw,needle", [
    (dict(nodes_train=0), "--nodes-train=0"),
    (dict(nodes_rollout=-1), "--nodes-rollout=-1"),
    (dict(gpus_per_node=8, gpus_per_engine=3), "--gpus-per-engine=3"),
    (dict(server="sglang"), "SGLang servers need GPUs"),
    (dict(time_min=2, signal_lead_s=120), "signal lead 120 s"),
    (dict(nodes_rollout=100, gpus_per_node=8, gpus_per_engine=1), "ports a job owns"),
])
def test_check_plan_rejects_with_the_flag_named(kw, needle):
    with pytest.raises(ValueError, match="invalid launch plan") as info:
        lp.check_plan(make_plan(**kw))
    assert needle in str(info.value)


def test_check_plan_accepts_a_gpu_layout():
    lp.check_plan(make_plan(nodes_train=4, nodes_rollout=2, gpus_per_node=8, gpus_per_engine=4, time_min=240))


def test_trainer_argv_is_torchrun_with_resume_auto_and_layout_overrides_last():
    plan = make_plan(nodes_train=2, gpus_per_node=8, overrides=["rollout.engine_urls=[]", "run.num_steps=3"])
    argv = lp.trainer_argv(plan, python="/py", node_rank=1, master_addr="10.0.0.5", master_port=20198,
                           layout_overrides=["rollout.engine_urls=[\"http://a:1\"]"], wait_for=["http://a:1"])
    assert argv[:3] == ["/py", "-m", "torch.distributed.run"]
    for flag in ("--nnodes=2", "--nproc-per-node=8", "--node-rank=1", "--master-addr=10.0.0.5",
                 "--master-port=20198"):
        assert flag in argv
    entry = argv[argv.index("-m", 3):]
    assert entry[:4] == ["-m", "sao_megatron.launch.train_entry", "--wait-for", "http://a:1"]
    tail = entry[entry.index("--") + 1:]
    assert tail[0] == "train"
    assert tail[tail.index("--resume") + 1] == "auto"
    sets = [tail[i + 1] for i, a in enumerate(tail) if a == "--set"]
    assert sets == ["rollout.engine_urls=[]", "run.num_steps=3", "rollout.engine_urls=[\"http://a:1\"]"]


def test_cpu_trainer_runs_one_process_per_node_unless_told():
    assert lp.procs_per_node(make_plan()) == 1
    assert lp.procs_per_node(make_plan(procs_per_node=2)) == 2
    assert lp.trainer_world_size(make_plan(nodes_train=3, gpus_per_node=4)) == 12


def test_rollout_overrides_load_through_the_config_system():
    urls = ["http://10.0.0.6:20000", "http://[fe80::1]:20001"]
    sets = lp.rollout_overrides(urls, "http://10.0.0.6:20199")
    cfg = from_dict(ExperimentConfig, apply_overrides({}, sets))
    assert cfg.rollout.engine == "sglang"
    assert cfg.rollout.engine_urls == urls
    assert cfg.rollout.router == "sglang_router" and cfg.rollout.router_url == "http://10.0.0.6:20199"
    assert lp.rollout_overrides([], None) == []


def test_url_brackets_ipv6():
    assert lp.url("10.0.0.1", 5) == "http://10.0.0.1:5"
    assert lp.url("fe80::1", 5) == "http://[fe80::1]:5"


def test_engine_argv_sglang_gets_its_gpu_group():
    plan = make_plan(gpus_per_node=8, gpus_per_engine=2, engine_args=["--mem-fraction-static", "0.8"])
    argv = lp.engine_argv(plan, python="py", model_dir="/m", host="h", port=7, local_index=3,
                          return_routed_experts=True)
    assert argv[:3] == ["py", "-m", "sglang.launch_server"]
    assert argv[argv.index("--tp-size") + 1] == "2"
    assert argv[argv.index("--base-gpu-id") + 1] == "6"
    assert "--enable-return-routed-experts" in argv
    assert argv[-2:] == ["--mem-fraction-static", "0.8"]


def test_engine_argv_cpu_is_serve_local():
    argv = lp.engine_argv(make_plan(), python="py", model_dir="/m", host="127.0.0.1", port=9, local_index=0)
    assert argv == ["py", "-m", "sao_megatron.cli", "serve-local", "--model-dir", "/m",
                    "--host", "127.0.0.1", "--port", "9", "--weight-version", "0"]


def test_router_argv_never_retries_and_owns_its_ports():
    argv = lp.router_argv(python="py", host="10.0.0.6", port=20199, worker_urls=["http://a:1", "http://b:2"],
                          model_dir="/m", request_timeout_s=120.0, api_key="k")
    assert "--disable-retries" in argv  # a retried /generate could train a prompt twice
    i = argv.index("--worker-urls")
    assert argv[i + 1:i + 3] == ["http://a:1", "http://b:2"]
    assert argv[argv.index("--prometheus-port") + 1] == str(20000 + lp.PROMETHEUS_PORT_OFFSET)
    assert argv[argv.index("--tokenizer-path") + 1] == "/m" and argv[-2:] == ["--api-key", "k"]


@pytest.mark.parametrize("text,minutes", [("90", 90), ("1:30:00", 90), ("1:30", 90), ("2-00:00:00", 2880),
                                          ("0:00:30", 1)])
def test_parse_time(text, minutes):
    assert parse_time_min(text) == minutes


def test_sbatch_script_is_valid_bash():
    script = pathlib.Path(__file__).resolve().parents[2] / "slurm" / "sao_rl.sbatch"
    proc = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
