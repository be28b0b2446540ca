"""The engine's CPU-only fast path: Molt's own fp32 kernels (`kernels.py`, C sources built on first use) and the
linear layers' prepacked weights that call them (`packed.py`). Nothing here runs on a GPU."""
