"""A two-stage pipeline whose stage 1 (rank 1) dies after two steps, for the failure test."""

import os

import torch

import gradmesh
from gradmesh.layout.engine import split_model
from gradmesh.models.registry import MODELS

rt = gradmesh.init(pipeline_parallel=2)
torch.manual_seed(0)
model = MODELS.get("cnn")((1, 8, 8), 10)
x, y = torch.randn(16, 1, 8, 8), torch.randint(0, 10, (16,))
split = split_model(model, "cnn", rt, 4, "1f1b", "6", x[:1])
for step in range(100):
    if step == 2 and rt.rank == 1:
        os._exit(3)
    split.engine.step(x, y, 1.0)
