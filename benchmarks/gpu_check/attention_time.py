"""Forward + backward attention time per kernel, head shape and packing, with JAX's own Pallas
flash attention (jax.experimental.pallas.ops.gpu.attention) beside ours on unpacked input.
TFLOP/s count causal work: S^2/2 query-key pairs unpacked, the sum of L^2/2 over the documents
packed (a kernel that skips other documents' blocks does only that work)."""

from __future__ import annotations

import statistics

from .attention_check import inputs, jitted_kernel, loss_and_grads, off_gpu, packing
from .common import GiB, Shapes, out_of_memory, skip, timed

UPSTREAM = "upstream pallas"  # the timing rows' name for _upstream_pallas_attention
KERNEL_NAMES = ("xla", "cudnn", "pallas", "blockwise", UPSTREAM)


def case_name(impl: str, seq: int, heads, docs: int, shapes: Shapes) -> str:
    """'cudnn, 16384 tokens' for the 1B's heads unpacked (the names benchmarks/calibrate.py
    reads), the head_dim and documents appended otherwise."""
    name = f"{impl}, {seq} tokens"
    if heads != shapes.time_heads[0]:
        name += f", head_dim {heads[2]}"
    return name + (f", {packing(docs)}" if docs else "")


def timing_cases(shapes: Shapes, seq: int):
    """(name, impl, seq, heads, documents) at one length, the 1B's heads unpacked first (what
    the calibration reads)."""
    for docs in shapes.long_documents if seq == shapes.long_seq else shapes.documents:
        for heads in shapes.time_heads:
            for impl in KERNEL_NAMES:
                yield case_name(impl, seq, heads, docs, shapes), impl, seq, heads, docs


def _upstream_missing() -> str | None:
    """Why JAX's own kernel cannot be timed here: jax 0.12.1 dropped its Triton Pallas examples."""
    import importlib.util

    import jax

    if importlib.util.find_spec("jax.experimental.pallas.ops.gpu.attention") is None:
        return f"jax {jax.__version__} ships no jax.experimental.pallas.ops.gpu.attention"
    return None


def _upstream_pallas_attention(heads, interpret: bool):
    """JAX's own Pallas/Triton flash attention (mha), what our `pallas` kernel (basp_jax.flash)
    is timed against: it takes as many k/v heads as query heads, so k and v are repeated to
    them (the copy our kernel avoids), default blocks."""
    import jax.numpy as jnp
    from jax.experimental.pallas.ops.gpu import attention as upstream

    group = heads[0] // heads[1]

    def fn(q, k, v, seg):
        k, v = (jnp.repeat(x, group, axis=2) for x in (k, v))
        return upstream.mha(q, k, v, None, sm_scale=heads[2] ** -0.5, causal=True,
                            interpret=interpret)

    return fn


def not_timed(impl: str, seq: int, heads, docs: int, shapes: Shapes, on_gpu: bool) -> str | None:
    """Why a case is not timed: what a kernel cannot run here, and what would spend the check's
    minutes without telling anything new."""
    from basp_jax.kernels import cudnn_supported, device_capability

    if impl == UPSTREAM:
        if docs:
            return "JAX's own kernel is compared on unpacked input only"
        return _upstream_missing()
    if why := off_gpu(impl, on_gpu):
        return why
    if impl == "cudnn" and docs and not _packed_cudnn():
        return ("packed input before Hopper: auto never runs cudnn there (it would take the "
                "segment mask as a dense S x S bias); pallas does")
    if impl == "xla" and docs:
        return "the xla kernel's work and memory do not depend on the packing (S x S scores)"
    if impl == "xla" and on_gpu:
        import jax

        scores = heads[0] * seq * seq * 4  # float32, before the backward pass's copies
        usable = (jax.devices()[0].memory_stats() or {}).get("bytes_limit")
        if usable and scores > usable:
            return (f"out of memory: the S x S float32 scores alone take {scores / GiB:,.0f} GiB "
                    f"of {usable / GiB:.0f}")
    if impl == "blockwise" and seq == shapes.long_seq and (docs or heads != shapes.time_heads[0]):
        return ("the blockwise fallback is timed at this length for the 1B's heads unpacked only: "
                "its calls take seconds, and its rate hardly changes with the length")
    if impl == "cudnn":
        import jax
        import jax.numpy as jnp

        q = jax.ShapeDtypeStruct((1, seq, heads[0], heads[2]), jnp.dtype(shapes.dtype))
        if not cudnn_supported(q, "gpu", device_capability(jax.devices()[0])):
            return (f"cuDNN flash attention is used for head_dim <= 128 (256 on Hopper and "
                    f"newer), not {heads[2]}")
    return None


def _packed_cudnn() -> bool:
    """Whether this GPU runs cuDNN's packed layout (basp_jax.cudnn)."""
    import jax

    from basp_jax import cudnn
    from basp_jax.kernels import device_capability

    return cudnn.packed_supported(device_capability(jax.devices()[0]))


def causal_pairs(seq: int, seg) -> float:
    """Query-key pairs of causal attention: S^2/2, or the sum of L^2/2 over the documents."""
    import numpy as np

    if seg is None:
        return seq * seq / 2
    _, lengths = np.unique(np.asarray(seg[0]), return_counts=True)
    return float(np.sum(lengths.astype(np.float64) ** 2) / 2)


def time_kernel(impl: str, seq: int, heads, docs: int, shapes: Shapes, on_gpu: bool,
                repeats: int) -> dict:
    """Median seconds of one forward + backward pass of causal attention."""
    if why := not_timed(impl, seq, heads, docs, shapes, on_gpu):
        return skip(why)
    if impl == UPSTREAM:
        step = loss_and_grads(_upstream_pallas_attention(heads, interpret=not on_gpu))
    else:  # 4 and 64 documents share its compile
        step = jitted_kernel(impl, heads, seq)
    try:
        return _measure(step, seq, heads, docs, shapes, repeats)
    except Exception as e:  # noqa: BLE001
        if not out_of_memory(e):
            raise
        # expected of the xla kernel, which holds the S x S scores: a finding, not a failure
        print(f"  out of memory at {seq} tokens", flush=True)
        return {"status": "out of memory", "seq_len": seq, "error": " ".join(str(e).split())[:300]}


def _measure(step, seq: int, heads, docs: int, shapes: Shapes, repeats: int) -> dict:
    """The row of a forward + backward `step` (attention_check.loss_and_grads's) timed on fresh
    inputs: median seconds and causal TFLOP/s."""
    import jax.numpy as jnp

    q, k, v, ct, seg = inputs(heads, seq, docs, jnp.dtype(shapes.dtype))
    first, times = timed(step, (q, k, v, ct, seg), repeats)
    median = statistics.median(times)
    pairs = causal_pairs(seq, seg)
    # 4 FLOPs per pair and head dim forward (QK^T, PV), 2.5x that backward (5 matmuls)
    flops = 3.5 * 4 * pairs * heads[0] * heads[2]
    print(f"  {median * 1e3:9.2f} ms  ({flops / median / 1e12:.1f} TFLOP/s causal; compile + "
          f"first run {first:.1f} s)", flush=True)
    return {"status": "ok", "seq_len": seq, "heads": heads[0], "kv_heads": heads[1],
            "head_dim": heads[2], "documents": docs, "causal_pairs": pairs, "median_s": median,
            "times_s": times, "tflops": flops / median / 1e12, "first_call_s": first}


def tile_cases(shapes: Shapes, seq: int):
    """(name, heads, blocks): our Pallas kernel (basp_jax.flash) at the check's head_dims, 128
    and 256, unpacked, with the tiles basp_jax.flash.flash_blocks gives this GPU first and a few
    others beside them (smaller key or query blocks, a third pipeline stage): the rows the
    kernel's tiles per head_dim and GPU generation are chosen from."""
    from basp_jax.flash import FlashBlocks

    others = {128: (FlashBlocks(128, 64, 64, 64), FlashBlocks(64, 64, 64, 64),
                    FlashBlocks(128, 128, 64, 64, num_stages=3)),
              256: (FlashBlocks(64, 64, 64, 64), FlashBlocks(64, 64, 32, 32),
                    FlashBlocks(128, 64, 32, 32))}
    for heads in shapes.check_heads:
        candidates = [None, *others.get(heads[2], ())]
        if shapes.smoke:  # interpret mode: two of them show the rows' structure
            candidates = [None, FlashBlocks.square(shapes.block_size * 2)]
        for blocks in candidates:
            tiles = "this GPU's tiles" if blocks is None else _tiles(blocks)
            yield f"pallas, {seq} tokens, head_dim {heads[2]}, {tiles}", seq, heads, blocks


def _tiles(blocks) -> str:
    return (f"tiles {blocks.q}x{blocks.k} forward, {blocks.q_bwd}x{blocks.k_bwd} backward, "
            f"{blocks.num_stages} stages")


def time_tiles(seq: int, heads, blocks, shapes: Shapes, on_gpu: bool, repeats: int) -> dict:
    """Median seconds of our Pallas kernel's forward + backward with `blocks` (None: this GPU's,
    basp_jax.kernels.pallas_blocks). Tiles the GPU cannot compile (more shared memory than a
    block may take) are a finding, not a failure."""
    import jax

    from basp_jax.kernels import device_capability, pallas_attention, pallas_blocks

    if blocks is None:
        platform = "gpu" if on_gpu else "cpu"
        blocks = pallas_blocks(platform, shapes.block_size, device_capability(jax.devices()[0]))

    def fn(q, k, v, seg):
        return pallas_attention(q, k, v, causal=True, segment_ids=seg, blocks=blocks,
                                interpret=not on_gpu)

    try:
        row = _measure(loss_and_grads(fn), seq, heads, 0, shapes, repeats)
    except Exception as e:  # noqa: BLE001 (Triton's and XLA's errors have no common type)
        if out_of_memory(e) or "shared memory" not in str(e).lower():
            raise
        print(f"  does not compile: {_tiles(blocks)}", flush=True)
        return {"status": "does not compile", "tiles": _tiles(blocks),
                "error": " ".join(str(e).split())[:300]}
    return {**row, "tiles": _tiles(blocks)}


def ring_timing_cases(shapes: Shapes, seq: int):
    """(name, hops, seq, heads, documents): a zig-zag ring of 2 on packed documents, its hops
    as attention() runs them ("auto": cuDNN's where their masks express the hop) and all
    through our Pallas kernel; their rate is compared with the kernels' on the same input."""
    docs = shapes.documents[1] if len(shapes.documents) > 1 else 0
    for hops in ("auto", "pallas"):
        yield (f"ring 2, {hops} hops, {seq} tokens, {packing(docs)}", hops, seq,
               shapes.time_heads[0], docs)


def time_ring(hops: str, seq: int, heads, docs: int, shapes: Shapes, on_gpu: bool,
              repeats: int) -> dict:
    """Median seconds of one forward + backward pass of a ring of 2 hops on one device
    (attention_check.ring_of_two: every hop's kernel and merge, no ppermute)."""
    import jax
    import jax.numpy as jnp

    from basp_jax.kernels import device_capability, ring_hop_kernel

    from .attention_check import ring_of_two

    if not on_gpu:
        return skip("--cpu-smoke: ring hops are timed on a GPU only")
    hop = ring_hop_kernel(hops, "gpu", device_capability(jax.devices()[0]), heads[2],
                          shapes.block_size, jnp.dtype(shapes.dtype))
    step = loss_and_grads(ring_of_two(seq, not shapes.smoke, hop, shapes.block_size))
    q, k, v, ct, seg = inputs(heads, seq, docs, jnp.dtype(shapes.dtype))
    first, times = timed(step, (q, k, v, ct, seg), repeats)
    median = statistics.median(times)
    flops = 3.5 * 4 * causal_pairs(seq, seg) * heads[0] * heads[2]
    print(f"  {median * 1e3:9.2f} ms  ({flops / median / 1e12:.1f} TFLOP/s causal, hops "
          f"{hop.name}; compile + first run {first:.1f} s)", flush=True)
    return {"status": "ok", "seq_len": seq, "heads": heads[0], "kv_heads": heads[1],
            "head_dim": heads[2], "documents": docs, "hop_kernel": hop.name, "median_s": median,
            "times_s": times, "tflops": flops / median / 1e12, "first_call_s": first}
