"""Planning: what a layout and parameter sharding cost on given hardware, before anything runs.

    from basp_jax.planner import cost, gain
    pred = cost.predict(shape, layout, "fsdp", hw=cost.HARDWARE["a100-40gb-ib400"])

Built on the runtime core (basp_jax: Layout, sharding strategies, remat policies, the GPU
table); the core imports nothing from here.
"""
