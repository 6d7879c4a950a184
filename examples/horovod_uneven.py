"""A Horovod script for uneven data: each rank holds a different amount, runs out at a different
step and calls `hvd.join()`; objects travel with `broadcast_object` / `allgather_object`, and a
`barrier` orders the final report. Only its import line differs from a Horovod script.

gradmesh run -np 2 -- python examples/horovod_uneven.py
"""

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn

import gradmesh.horovod as hvd  # was: import horovod.torch as hvd

hvd.init()
torch.manual_seed(hvd.rank())

# rank 0 decides the run's settings; every rank receives them (int keys and tuples survive)
config = {"lr": 0.1, "batch": 32, 0: ("digits", 8)} if hvd.rank() == 0 else None
config = hvd.broadcast_object(config, root_rank=0)
name, size = config[0]

digits = load_digits()
x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
y = torch.tensor(digits.target)
order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
test, train = order[:360], order[360:]
# uneven shards: rank r gets r + 1 parts of the training set
parts = sum(range(1, hvd.size() + 1))
cut = [len(train) * sum(range(1, r + 1)) // parts for r in range(hvd.size() + 1)]
mine = train[cut[hvd.rank()] : cut[hvd.rank() + 1]]

model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
optimizer = torch.optim.SGD(model.parameters(), lr=config["lr"], momentum=0.9)
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())

steps = 0
for _epoch in range(4):
    for start in range(0, len(mine), config["batch"]):
        idx = mine[start : start + config["batch"]]
        optimizer.zero_grad()
        F.cross_entropy(model(x[idx]), y[idx]).backward()
        optimizer.step()
        steps += 1
# this rank is out of data: it takes part in the others' steps until every rank has joined
hvd.join()

with torch.no_grad():
    accuracy = (model(x[test]).argmax(1) == y[test]).float().mean().item()
stats = hvd.allgather_object({"rank": hvd.rank(), "samples": len(mine), "steps": steps})
weights = hvd.allgather(torch.cat([p.detach().reshape(-1) for p in model.parameters()])[None])
hvd.barrier()
if hvd.rank() == 0:
    for row in stats:
        print(f"rank {row['rank']}: {row['samples']} samples, {row['steps']} steps of its own")
    same = all(torch.equal(weights[0], w) for w in weights)
    print(f"{name} ({size}x{size}): replicas identical {same}, test accuracy {accuracy:.4f}")
hvd.shutdown()
