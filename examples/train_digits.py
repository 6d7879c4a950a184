"""A plain PyTorch training script made data-parallel with gradmesh in four lines (marked ###).

gradmesh run -np 2 -- python examples/train_digits.py
torchrun --standalone --nproc-per-node 2 examples/train_digits.py
python examples/train_digits.py          # a world of one
"""

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn

import gradmesh

gradmesh.init()  ###

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
optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
gradmesh.broadcast_parameters(model.state_dict(), root_rank=0)  ###
optimizer = gradmesh.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())  ###

batch_per_worker = 32
for epoch in range(10):
    shuffled = train[torch.randperm(len(train), generator=torch.Generator().manual_seed(epoch))]
    mine = shuffled[gradmesh.rank() :: gradmesh.size()]  # this worker's shard
    for start in range(0, len(mine) - batch_per_worker + 1, batch_per_worker):
        idx = mine[start : start + batch_per_worker]
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x[idx]), y[idx])
        loss.backward()
        optimizer.step()
    if gradmesh.rank() == 0:
        print(f"epoch {epoch + 1}: loss {loss.item():.4f}", flush=True)

with torch.no_grad():
    accuracy = (model(x[test]).argmax(1) == y[test]).float().mean().item()
if gradmesh.rank() == 0:
    print(f"test accuracy {accuracy:.4f} on {gradmesh.size()} workers")
gradmesh.shutdown()
