"""Models by name: each builder takes (input_shape, num_classes) and returns an `nn.Module`;
models of feature-id inputs (`FEATURE_ID_MODELS`) also take the number of ids, `vocab`.
`build_model` picks the call from the dataset and says which pairs do not fit.

A model that can be split over tensor-parallel ranks declares its plan next to its definition
(`TP_PLANS`: layer name -> colwise or rowwise, see `gradmesh.layout.tensor.layers`); every
`nn.Sequential` model can be cut into pipeline stages.

Importing the package imports no torch (the simulator's device table, `gradmesh.models.devices`,
serves commands that only build their options): the models register themselves on the first
lookup of a registry (`registry.load_models`).
"""
