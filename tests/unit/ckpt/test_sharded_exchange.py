"""Nothing of a sharded save or load travels between ranks as a pickle.

torch.distributed.checkpoint's coordinated save and load gather and scatter their plans with
``gather_object``/``scatter_object_list``, which unpickle what any peer of the unauthenticated
gloo group sends. sparkdl runs DCP on each rank alone and exchanges what it must as JSON. Two
real ranks (processes, gloo on loopback, an FSDP2 model) save and load a sharded checkpoint with
every object collective of torch made to fail; then one rank plays a peer that sends a pickle
where sparkdl expects its JSON, and the other refuses it by name without running it.
"""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

_RANK = r"""
import os, pickle, sys
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard

from sparkdl._internal.common.errors import SparkDLError
from sparkdl._internal.ckpt import sharded
from sparkdl._internal.ckpt.store import CheckpointStore

rank, port, root = int(sys.argv[1]), sys.argv[2], sys.argv[3]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=60))


def refuse(*args, **kwargs):
    raise AssertionError("an object collective (a pickle between ranks) was used")


for name in ("gather_object", "scatter_object_list", "broadcast_object_list", "all_gather_object"):
    setattr(dist, name, refuse)
    setattr(c10d, name, refuse)


def model(seed):
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.Linear(10, 3))
    fully_shard(net)
    return net, torch.optim.Adam(net.parameters(), lr=0.1)


net, opt = model(0)
net(torch.randn(4, 6)).sum().backward()
opt.step()
store = CheckpointStore(f"{root}/ckpt")
msd, osd = get_state_dict(net, opt)
seq = sharded.save(store, {"model": msd, "optimizer": osd, "note": "plain"})
other, other_opt = model(1)
msd, osd = get_state_dict(other, other_opt)
loaded = sharded.load(store, sharded.latest(store), {"model": msd, "optimizer": osd})
set_state_dict(other, other_opt, model_state_dict=loaded["model"], optim_state_dict=loaded["optimizer"])
for (k, a), (_, b) in zip(net.state_dict().items(), other.state_dict().items()):
    assert torch.equal(a.full_tensor(), b.full_tensor()), k
assert loaded["note"] == "plain" and seq == 1


class Planted:
    def __reduce__(self):
        return (os.makedirs, (f"{root}/ran",))


if rank == 1:
    # A peer that sends a pickle where sparkdl's exchange expects JSON, framed as sparkdl frames it.
    data = pickle.dumps(Planted())
    length = torch.tensor([len(data)], dtype=torch.int64)
    lengths = [torch.zeros_like(length) for _ in range(2)]
    dist.all_gather(lengths, length)
    mine = torch.zeros(max(int(n) for n in lengths), dtype=torch.uint8)
    mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    dist.all_gather([torch.empty_like(mine) for _ in range(2)], mine)
else:
    try:
        sharded.all_gather_json({"files": {}})
    except SparkDLError as exc:
        print("refused:", exc, flush=True)
dist.destroy_process_group()
print("done", flush=True)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.fault
def test_sharded_save_and_load_use_no_pickles_and_a_crafted_peer_message_is_refused(tmp_path: Path) -> None:
    port = str(_free_port())
    procs = [subprocess.Popen([sys.executable, "-c", _RANK, str(r), port, str(tmp_path)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]
    try:
        outs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
            p.wait(timeout=30)
    for r, (p, out) in enumerate(zip(procs, outs, strict=True)):
        assert p.returncode == 0 and out.rstrip().endswith("done"), f"rank {r}:\n{out}"
    assert "refused: rank 1 sent what is not JSON" in outs[0], outs[0]
    assert not (tmp_path / "ran").exists(), "a peer's pickle ran code"
    # One data file and one metadata file per rank, each written by its rank alone.
    shards = next((tmp_path / "ckpt").glob("shards-*"))
    assert sorted(p.name for p in shards.iterdir()) == ["__0.metadata", "__0_0.distcp", "__1.metadata", "__1_0.distcp"]
