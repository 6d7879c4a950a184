"""A plain PyTorch script trained by parameter servers: ranks 0..S-1 serve, the others train.

gradmesh run -np 3 -- python examples/ps_digits.py      # 1 server, 2 workers, ssp with K = 2
"""

import time

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn

from gradmesh.sync import parameter_server as ps

SERVERS = 1
role = ps.join(servers=SERVERS, mode="ssp", max_staleness=2, lr=0.1, momentum=0.5)  ###

digits = load_digits()
x = torch.tensor(digits.data, dtype=torch.float32).reshape(-1, 1, 8, 8) / 16.0
y = torch.tensor(digits.target)
g = torch.Generator().manual_seed(0)
order = torch.randperm(len(y), generator=g)
test, train = order[:360], order[360:]

torch.manual_seed(0)
model = nn.Sequential(
    nn.Conv2d(1, 16, 3, padding=1),
    nn.ReLU(),
    nn.MaxPool2d(2),
    nn.Flatten(),
    nn.Linear(16 * 16, 64),
    nn.ReLU(),
    nn.Linear(64, 10),
)
worker = ps.PSWorker(role, servers=SERVERS, push_every=1, pull_every=1, timeout_s=60)  ###
optimizer = worker.attach(model, torch.optim.SGD(model.parameters(), lr=0.05))  ###

started, samples, batch = time.perf_counter(), 0, 32
for epoch in range(10):
    shuffled = train[torch.randperm(len(train), generator=torch.Generator().manual_seed(epoch))]
    mine = shuffled[role.index :: role.workers]  # this worker's shard
    for start in range(0, len(mine) - batch + 1, batch):
        idx = mine[start : start + batch]
        optimizer.zero_grad()
        F.cross_entropy(model(x[idx]), y[idx]).backward()
        optimizer.step()  # push the gradient, pull the parameters
        samples += len(idx)
worker.finish(samples, time.perf_counter() - started)  ###  the reporter holds the final model
if worker.reporter:
    with torch.no_grad():
        accuracy = (model(x[test]).argmax(1) == y[test]).float().mean().item()
    staleness = worker.report()["staleness_histogram"]
    print(f"test accuracy {accuracy:.4f} with {role.workers} workers; staleness {staleness}")
