"""A weight-update group formed inside a torchrun worker: the trainer's end (group rank 0, this
package's ``init_custom_process_group``) and a receiver that joins as SGLang 0.5.23 does.

    torchrun --nproc_per_node=1 [torch211_store.py] update_group_torchrun.py RESULTS.json

RESULTS: ``control`` (what a rank-0 ``tcp://`` rendezvous gets here: "formed", or the error when the
torch ≤ 2.11 rule is in force and makes rank 0 a client), ``sent``/``received`` (one broadcast over
the group) and ``env`` (this worker's environment, as torchrun set it).
"""

import inspect
import json
import multiprocessing as mp
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from sao_megatron.net import free_port
from sao_megatron.rollout.update_group import init_custom_process_group

GROUP = "sao_update_torchrun"
TIMEOUT = timedelta(seconds=20)
"""Joining takes well under a second here; under the old rule the sender waits this long, then fails."""


def sglang_receiver(port: int, conn) -> None:
    """Rank 1 as sglang 0.5.23's ``init_custom_process_group`` joins with ``init_method="tcp://..."``:
    torch's tcp rendezvous, its timeout on the store, ``PrefixStore(group_name)``, the group helper."""
    store, rank, world_size = next(c10d.rendezvous(f"tcp://127.0.0.1:{port}", 1, 2, timeout=TIMEOUT))
    store.set_timeout(TIMEOUT)
    store = c10d.PrefixStore(GROUP, store)
    options = "backend_options" if "backend_options" in inspect.signature(c10d._new_process_group_helper).parameters \
        else "pg_options"  # the name before torch 2.6
    group, _ = c10d._new_process_group_helper(world_size, rank, [], c10d.Backend("gloo"), store,
                                              group_name=GROUP, timeout=TIMEOUT, **{options: None})
    c10d._world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    received = torch.empty(6)
    dist.broadcast(received, 0, group=group)
    conn.send(received.tolist())


def control() -> str:
    """A rank-0 tcp:// rendezvous of a world of one: forms at once unless rank 0 is made a client."""
    try:
        next(c10d.rendezvous(f"tcp://127.0.0.1:{free_port()}", 0, 1, timeout=timedelta(seconds=1)))
    except Exception as exc:  # noqa: BLE001 - the refusal is the result
        return f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
    return "formed"


def main(results: str) -> None:
    port = free_port()
    parent, child = mp.get_context("fork").Pipe()
    receiver = mp.get_context("fork").Process(target=sglang_receiver, args=(port, child))
    receiver.start()  # forked before this process made any store (and its threads)
    out = {"control": control(), "env": dict(os.environ)}
    group = init_custom_process_group(backend="gloo", master_address="127.0.0.1", master_port=port, world_size=2,
                                      rank=0, group_name=GROUP, timeout=TIMEOUT)
    sent = torch.arange(6, dtype=torch.float32) * 1.5
    dist.broadcast(sent, 0, group=group)
    out.update(sent=sent.tolist(), received=parent.recv())
    receiver.join(30)
    out["receiver_exitcode"] = receiver.exitcode
    with open(results, "w") as fh:
        json.dump(out, fh)


if __name__ == "__main__":
    main(sys.argv[1])
