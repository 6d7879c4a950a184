"""A two-stage pipeline whose stage 1 (rank 1) dies after two steps, for the failure test."""

import os

import torch

import gradmesh
from gradmesh.layout.config import LayoutConfig
from gradmesh.models.registry import MODELS

rt = gradmesh.init(pipeline_parallel=2)
torch.manual_seed(0)
model = MODELS.get("cnn")((1, 8, 8), 10)
x, y = torch.randn(16, 1, 8, 8), torch.randint(0, 10, (16,))
layout = LayoutConfig(pipeline_parallel=2, microbatches=4, stages="6")
split = gradmesh.parallelize(model, layout, example=x[:1], name="cnn")
for step in range(100):
    if step == 2 and rt.rank == 1:
        os._exit(3)
    split.engine.step(x, y, 1.0)
