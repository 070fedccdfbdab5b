"""Planning: what a layout and parameter sharding cost on given hardware, before anything runs.

    from basp_jax.planner import cost, gain
    from basp_jax.planner.hardware import HARDWARE
    pred = cost.predict(shape, layout, "fsdp", hw=HARDWARE["a100-40gb"])

hardware (the cluster presets), shape (a model's sizes), precisions (the bytes of each kind of
number), traffic (the bytes a step sends), memory (the fitted memory model), cost (the
prediction and the layout search) and gain (whether adaptive layouts pay); calibration holds the
measured rates of a GPU kind. Built on the runtime core (basp_jax: Layout, sharding strategies,
remat policies, the GPU table); the core imports nothing from here.
"""
