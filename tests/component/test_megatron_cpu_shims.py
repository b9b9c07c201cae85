"""The CPU shims: version guard, and proof that each one is still needed.

Every shim is also exercised by the behavioural tests (test_megatron_parallel.py,
test_megatron_single.py); the slow tests below remove one shim at a time and check that
the probe (mp_scripts/shim_probe.py: build, train with the distributed optimizer, checkpoint
and reload, expert dispatch) then fails.
"""

from __future__ import annotations

import pytest
from megatron_launch import run, tail

pytestmark = pytest.mark.component

SINGLE_PROCESS = ["torch_cuda_stubs", "device_mode", "rng_tracker", "dist_optimizer_step_state"]
MULTI_RANK = ["alltoall_splits", "uneven_allgather"]  # need EP > 1 / expert-TP > 1
# Only DSA models reach it; test_convert_mla shows the unshimmed rotate_activation failing on CPU.
MODEL_SPECIFIC = ["dsa_hadamard"]


def test_other_megatron_versions_are_refused_with_the_fix(monkeypatch):
    from megatron.core import package_info

    from sao_megatron.parallel import cpu_support

    monkeypatch.setattr(package_info, "__version__", "0.20.0")
    with pytest.raises(cpu_support.MegatronVersionError) as err:
        cpu_support.check_megatron_version()
    msg = str(err.value)
    assert "0.20.0" in msg and "0.19.2" in msg and "pip install megatron-core==0.19.2" in msg


def test_installed_version_is_supported():
    from sao_megatron.parallel import cpu_support

    cpu_support.check_megatron_version()


def test_unknown_shim_name_is_rejected_before_patching():
    from sao_megatron.parallel import cpu_support

    before = cpu_support.shims_applied()  # earlier tests in this process may have patched it already
    with pytest.raises(ValueError, match="unknown CPU shim"):
        cpu_support.apply_cpu_shims(skip=["no_such_shim"])
    assert cpu_support.shims_applied() == before


def test_every_shim_says_what_breaks_without_it():
    from sao_megatron.parallel import cpu_support

    assert set(cpu_support.SHIMS) == set(SINGLE_PROCESS + MULTI_RANK + MODEL_SPECIFIC)
    for name, fn in cpu_support.SHIMS.items():
        assert fn.__doc__ and "Without it:" in fn.__doc__, name


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [None, 4], ids=["world1", "world4"])
def test_probe_passes_with_all_shims(tmp_path, nproc):
    proc = run("shim_probe.py", str(tmp_path), nproc=nproc, timeout=600)
    assert "OK" in proc.stdout, tail(proc)


@pytest.mark.slow
@pytest.mark.parametrize("name", SINGLE_PROCESS + MULTI_RANK)
def test_each_shim_is_needed(tmp_path, name):
    nproc = 4 if name in MULTI_RANK else None
    proc = run("shim_probe.py", str(tmp_path), "--skip", name, nproc=nproc, timeout=600, check=False)
    assert proc.returncode != 0 and "OK" not in proc.stdout, f"probe passed without shim {name}:\n{tail(proc)}"
