"""Readers of compiled programs: HLO instructions with their trip counts (hlo) and the
collectives they run, by kind, bytes and device groups (comm).

    from basp_jax.compiled import comm, hlo

They read what XLA wrote; the runtime core imports nothing from here.
"""
