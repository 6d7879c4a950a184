"""Replica groups from a script of one's own: R groups of one model, whose gradients are averaged
over the groups alive each step; a group that dies is restarted by its launcher and copies the
state from a peer, while the others go on without a restart.

gradmesh lighthouse --groups 2 --port 29600 &
gradmesh run -np 1 --max-restarts 1 -- python examples/replica_groups.py --group 0 --groups 2
gradmesh run -np 1 --max-restarts 1 -- python examples/replica_groups.py --group 1 --groups 2

Each group's rank 0 writes its report (quorum changes, copies, steps taken again) and a SHA-256
of its parameters to --json: groups that ended together print the same. --kill-after S kills
this group's rank 0 after step S in its first attempt, and --step-ms makes each step that much
longer, standing for a bigger model (a demonstration of recovery).
"""

import argparse
import hashlib
import json
import os
import signal
import time

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn

import gradmesh
from gradmesh.runtime.process import restarts

parser = argparse.ArgumentParser()
parser.add_argument("--group", type=int, required=True)
parser.add_argument("--groups", type=int, required=True)
parser.add_argument("--lighthouse", default="127.0.0.1:29600")
parser.add_argument("--steps", type=int, default=200)
parser.add_argument("--batch", type=int, default=64, help="the global batch of all groups")
parser.add_argument("--compression", default="none")
parser.add_argument("--kill-after", type=int, default=-1)
parser.add_argument("--json", default="")
parser.add_argument(
    "--step-ms", type=float, default=0, help="sleep this long a step (a bigger model)"
)
args = parser.parse_args()

gradmesh.init()
torch.manual_seed(0)  # every group starts from the same model
digits = load_digits()
x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
y = torch.tensor(digits.target)

model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
optimizer = torch.optim.AdamW(model.parameters(), lr=0.003)
if gradmesh.size() > 1:  # the group's own data parallelism, inside it
    optimizer = gradmesh.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
group = gradmesh.ReplicaGroup(
    model,
    optimizer,
    lighthouse=args.lighthouse,
    group=args.group,
    groups=args.groups,
    compression=args.compression,
)

while group.steps < args.steps:
    if not group.start_step():  # the run ended before this group could join
        break
    # the step's global batch depends only on the step: split over the groups alive, then
    # over this group's ranks
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(group.steps))
    mine = torch.tensor_split(order[: args.batch], len(group.quorum.members))[group.quorum.index]
    mine = torch.tensor_split(mine, gradmesh.size())[gradmesh.rank()]
    group.optimizer.zero_grad()
    F.cross_entropy(model(x[mine]), y[mine]).backward()
    time.sleep(args.step_ms / 1000)
    if not group.step():  # a group was lost mid-step: nothing applied, take it again
        continue
    if group.steps == args.kill_after and gradmesh.rank() == 0 and restarts() == 0:
        os.kill(os.getpid(), signal.SIGKILL)
group.finish()

accuracy = (model(x).argmax(1) == y).float().mean().item()
digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters()))
if gradmesh.rank() == 0:
    print(f"group {args.group}: step {group.steps}, accuracy {accuracy:.4f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    **group.report(),
                    "steps": group.steps,
                    "accuracy": accuracy,
                    "parameters_sha256": digest.hexdigest(),
                },
                f,
            )
