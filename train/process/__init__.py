"""What runs around the trainer in a process: the JAX runtime and its GPU defaults (runtime,
gpu_defaults), the run directory's lock and output checks (lock, outputs), the peers' watch in
multi-process runs (peers) and the stop agreement (stop). The trainer core (train.loop and what
it calls) and the command line (train.cli) use these; none of them trains or imports the core."""
