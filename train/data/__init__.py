"""The data path: token sources, the start-up packing of documents into rows, synthetic corpora,
and each step's batch on the run's layout (or, under adaptive layouts, on the one it chooses).

    pipeline.py   Pipeline: the rows of step t, a pure function of (seed, t), on the mesh
    sources.py    token files as windows or first-fit packed documents, in seeded epochs (Grain)
    synthetic.py  a learnable Markov chain and named document-length distributions
    batches.py    the batch of each step and the program (layout) that runs it
"""

from .pipeline import DataError, Pipeline, check_files, checked_sidecar, parse_lines, sidecar_seal

__all__ = ["DataError", "Pipeline", "check_files", "checked_sidecar", "parse_lines", "sidecar_seal"]
