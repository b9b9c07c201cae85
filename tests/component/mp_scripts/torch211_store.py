"""Run a script or a module under torch ≤ 2.11's store rule for torchrun workers, on any newer torch.

    python torch211_store.py SCRIPT ARGS...            python torch211_store.py -m MODULE ARGS...

torch ≤ 2.11 (``torch/distributed/rendezvous.py``, ``_create_c10d_store``): when the environment has
``TORCHELASTIC_USE_AGENT_STORE=True``, which torchrun gives every worker, each rank of *any*
``tcp://`` or ``env://`` rendezvous becomes a client of a store the elastic agent is assumed to host
at that address; no rank serves it. torch 2.14 (the project's CPU pin) applies the rule only at the
agent's own ``MASTER_ADDR:MASTER_PORT``, so a group at another port forms there and hangs on the
torch of the first GPU node (2.11.0). This wrapper puts the old rule back for the run, so a CPU test
under torchrun sees what that node saw. It changes that one function and nothing else; the default
process group still forms (the agent does host its own store).
"""

import os
import runpy
import sys
from datetime import timedelta


def create_store_as_torch_2_11(hostname, port, rank, world_size, timeout: timedelta, use_libuv=True):
    """torch ≤ 2.11's ``_create_c10d_store``: under the agent-store flag every rank is a client."""
    from torch.distributed import TCPStore

    if not 0 <= port < 2**16:
        raise ValueError(f"port must have value from 0 to 65535 but was {port}.")
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True):
        return TCPStore(host_name=hostname, port=port, world_size=world_size, is_master=False, timeout=timeout)
    return TCPStore(host_name=hostname, port=port, world_size=world_size, is_master=rank == 0, timeout=timeout,
                    multi_tenant=True, use_libuv=use_libuv)


def apply() -> None:
    """Install the old rule (both handlers look the function up in their module at call time)."""
    import importlib

    rdzv = importlib.import_module("torch.distributed.rendezvous")  # the package's ``rendezvous`` is the function
    assert callable(getattr(rdzv, "_create_c10d_store", None)), "torch no longer has _create_c10d_store"
    rdzv._create_c10d_store = create_store_as_torch_2_11


if __name__ == "__main__":
    apply()
    if sys.argv[1] == "-m":
        sys.argv = sys.argv[2:]
        runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
    else:
        sys.argv = sys.argv[1:]
        sys.path[0] = os.path.dirname(os.path.abspath(sys.argv[0]))
        runpy.run_path(sys.argv[0], run_name="__main__")
