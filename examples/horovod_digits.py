"""A Horovod PyTorch training script; the only change for gradmesh is its import line.

gradmesh run -np 2 -- python examples/horovod_digits.py
"""

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn

import gradmesh.horovod as hvd  # was: import horovod.torch as hvd

hvd.init()
torch.manual_seed(0)

digits = load_digits()
x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
y = torch.tensor(digits.target)
order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
test, train = order[:360], order[360:]

model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
# Horovod's large-batch recipe: scale the learning rate by the number of workers
optimizer = torch.optim.SGD(model.parameters(), lr=0.05 * hvd.size(), momentum=0.9)
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
hvd.broadcast_optimizer_state(optimizer, root_rank=0)
optimizer = hvd.DistributedOptimizer(
    optimizer, named_parameters=model.named_parameters(), compression=hvd.Compression.fp16
)

for epoch in range(8):
    mine = train[hvd.rank() :: hvd.size()]
    for start in range(0, len(mine), 32):
        idx = mine[start : start + 32]
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x[idx]), y[idx])
        loss.backward()
        optimizer.step()
    mean_loss = hvd.allreduce(loss.detach(), name="loss")
    if hvd.rank() == 0:
        print(f"epoch {epoch + 1}: loss {mean_loss.item():.4f}", flush=True)

hvd.join()
with torch.no_grad():
    accuracy = (model(x[test]).argmax(1) == y[test]).float().mean()
accuracy = hvd.allreduce(accuracy)
if hvd.rank() == 0:
    print(f"test accuracy {accuracy.item():.4f} on {hvd.size()} workers")
hvd.shutdown()
