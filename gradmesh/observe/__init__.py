"""Seeing a run: timelines (`timeline`), TensorBoard scalars (`metrics`), plots (`plot`).
Usable from every layer above the runtime: nothing here imports a strategy or a layout."""
