"""Stand-alone commands beside the trainer, each `python -m train.tools.NAME` (console scripts:
basp-aot, basp-plan, basp-tokenize, basp-generate): compile a run for GPUs without one (aot),
rank layouts with the cost model (plan), tokenize a corpus (tokenize), sample from a model or a
run's checkpoint (generate), draw figures (plot), write the config reference (config_doc), the
library's forward-only demo (demo); and, for benchmarks and tests, the collectives of the
trainer's step compiled for a shape (collectives). Nothing in train/ or below imports them."""
