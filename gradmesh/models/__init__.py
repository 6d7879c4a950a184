"""Models by name: each builder takes (input_shape, num_classes) and returns an `nn.Module`;
models of feature-id inputs (`FEATURE_ID_MODELS`) also take the number of ids, `vocab`.
`build_model` picks the call from the dataset and says which pairs do not fit.

A model that can be split over tensor-parallel ranks declares its plan next to its definition
(`TP_PLANS`: layer name -> colwise or rowwise, see `gradmesh.layout.tensor.layers`); every
`nn.Sequential` model can be cut into pipeline stages."""

from gradmesh.models import gpt, hf, imagenet, small  # noqa: F401  (they register their models)
from gradmesh.models.registry import *  # noqa: F403
