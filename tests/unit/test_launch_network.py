"""Interface selection for gloo/NCCL on launched nodes (launch/network.py) and its use by the node runner."""

from __future__ import annotations

import socket

import psutil
import pytest

from sao_megatron import net
from sao_megatron.launch import network
from sao_megatron.launch import node as nd
from sao_megatron.launch.layout import LaunchPlan

pytestmark = pytest.mark.unit

NODE = {"lo": ["127.0.0.1"], "eth0": ["10.1.0.5"], "ib0": ["192.168.7.5", "192.168.8.5"], "docker0": []}


def test_auto_picks_the_interface_that_carries_the_node_address():
    assert network.select_iface("auto", "10.1.0.5", NODE) == "eth0"
    assert network.select_iface("auto", "192.168.8.5", NODE) == "ib0"  # a secondary address counts too


def test_auto_on_this_machine_matches_psutil():
    """Reference: walk psutil's own table for the interface holding 127.0.0.1."""
    expected = next(n for n, addrs in psutil.net_if_addrs().items()
                    if any(a.family == socket.AF_INET and a.address == "127.0.0.1" for a in addrs))
    assert network.select_iface("auto", "127.0.0.1") == expected


def test_auto_without_a_matching_interface_lists_the_choices():
    with pytest.raises(ValueError, match=r"has its node address 10\.9\.9\.9.*--iface.*eth0 \(10\.1\.0\.5\)"):
        network.select_iface("auto", "10.9.9.9", NODE)


def test_named_interface_must_exist():
    assert network.select_iface("ib0", "10.1.0.5", NODE) == "ib0"  # not the NodeAddr's: the user chose
    with pytest.raises(ValueError, match=r"--iface 'ib1' does not exist.*docker0 \(no IPv4\)"):
        network.select_iface("ib1", "10.1.0.5", NODE)


def test_unresolvable_node_address_says_what_to_fix():
    with pytest.raises(ValueError, match="does not resolve"):
        network.select_iface("auto", "no-such-node.invalid", NODE)


@pytest.mark.parametrize("addrs, ok", [
    (["127.0.0.1"], True),                        # one node
    (["127.0.0.11", "127.0.0.12"], True),          # single-host cluster on loopback addresses
    (["127.0.1.1", "10.1.0.6"], False),            # own name on 127.0.1.1, the others real
    (["10.1.0.5", "10.1.0.6", "127.0.0.1"], False),
    (["10.1.0.5", "10.1.0.6"], True),
])
def test_half_loopback_node_addresses_are_rejected(addrs, ok):
    if ok:
        network.check_reachable(addrs)
    else:
        with pytest.raises(ValueError, match="resolve to loopback"):
            network.check_reachable(addrs)


def test_node_env_sets_both_variables_for_every_started_process(monkeypatch):
    monkeypatch.setattr(network, "interface_addresses", lambda: NODE)
    monkeypatch.setenv("KEEP_ME", "1")
    alloc = nd.Allocation(job_id=3, restart=0, train_addrs=["10.1.0.5", "10.1.0.6"], rollout_addrs=["10.1.0.7"],
                          port_base=20600)
    env = nd.node_env(LaunchPlan(config="/c.yaml", run_dir="/r"), alloc, "10.1.0.5")
    assert env["GLOO_SOCKET_IFNAME"] == env["NCCL_SOCKET_IFNAME"] == "eth0" and env["KEEP_ME"] == "1"
    env = nd.node_env(LaunchPlan(config="/c.yaml", run_dir="/r", iface="ib0"), alloc, "10.1.0.5")
    assert env["GLOO_SOCKET_IFNAME"] == env["NCCL_SOCKET_IFNAME"] == "ib0"


def test_iface_flag_reaches_the_plan():
    import argparse

    parser = argparse.ArgumentParser()
    nd.add_plan_args(parser)
    args = parser.parse_args(["--config", "/c.yaml", "--run-dir", "/r", "--iface", "ib0"])
    assert nd.plan_from_args(args).iface == "ib0"
    assert nd.plan_from_args(parser.parse_args(["--config", "/c.yaml", "--run-dir", "/r"])).iface == "auto"


def test_ephemeral_port_range_is_read_from_the_sysctl_file(tmp_path):
    sysctl = tmp_path / "ip_local_port_range"
    sysctl.write_text("32768\t60999\n")  # the kernel's format
    assert net.ephemeral_port_range(str(sysctl)) == (32768, 60999)
    sysctl.write_text("61000 1024\n")
    assert net.ephemeral_port_range(str(sysctl)) == (1024, 61000)
    sysctl.write_text("32768\n")
    with pytest.raises(ValueError, match="two port numbers"):
        net.ephemeral_port_range(str(sysctl))
    assert net.ephemeral_port_range(str(tmp_path / "absent")) == net.LINUX_DEFAULT_EPHEMERAL
