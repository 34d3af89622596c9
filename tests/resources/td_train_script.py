"""A training script written for torchrun / Spark's TorchDistributor: argv in, a file out."""

import argparse
import json

import torch
import torch.distributed as dist

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--lr", type=float, default=0.1)
args = parser.parse_args()

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
w = torch.zeros(3, requires_grad=True)
x = torch.arange(6.0).reshape(2, 3) + rank
for _ in range(20):
    loss = (x @ w - 1.0).pow(2).mean()
    loss.backward()
    with torch.no_grad():
        dist.all_reduce(w.grad)
        w -= args.lr * w.grad / world
        w.grad.zero_()
if rank == 0:
    with open(args.out, "w") as f:
        json.dump({"w": w.tolist(), "world": world}, f)
dist.destroy_process_group()
