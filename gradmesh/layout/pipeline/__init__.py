"""Pipeline parallelism on the mesh's pp axis: the schedules and the layer-sequence cut
(`schedules.py`), the stage engine that runs a schedule (`engine.py`), any model cut on its
graph (`graph.py`), what each cut carries (`routes.py`), and that cut's engine with the
script's `gradmesh.pipeline_stage` (`stages.py`)."""
