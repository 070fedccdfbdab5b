"""Every attention kernel against a float32 reference: the output and the three input gradients,
per head shape, packing (documents per row) and half-precision dtype; and a ring of 2 hops
(basp_jax/ring.py's hop kernels and merges) against the same reference."""

from __future__ import annotations

import functools

from .common import Shapes, skip


def packing(docs: int) -> str:
    return f"{docs} documents" if docs else "unpacked"


def reference_attention(q, k, v, segment_ids):
    """Causal softmax attention in float32 with an explicit mask: the independent reference."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    s, group = q.shape[1], q.shape[2] // k.shape[2]
    k, v = (jnp.repeat(x.astype(jnp.float32), group, axis=2) for x in (k, v))
    # precision="highest": full float32 on GPUs too (their default f32 matmul is TF32)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q.astype(jnp.float32), k,
                        precision="highest") / np.sqrt(q.shape[-1])
    mask = jnp.tril(jnp.ones((s, s), bool))[None, None]
    if segment_ids is not None:
        mask = mask & (segment_ids[:, None, :, None] == segment_ids[:, None, None, :])
    probs = jax.nn.softmax(jnp.where(mask, scores, -jnp.inf), axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", probs, v, precision="highest")


def inputs(heads: tuple[int, int, int], seq: int, docs: int, dtype, seed: int = 0):
    """q, k, v, the output's cotangent, and segment ids (None unpacked; else `docs` documents
    of random lengths, back to back)."""
    import jax
    import jax.numpy as jnp

    hq, hkv, hd = heads
    kq, kk, kv, kc, ks = jax.random.split(jax.random.PRNGKey(seed), 5)
    q = jax.random.normal(kq, (1, seq, hq, hd), dtype)
    k = jax.random.normal(kk, (1, seq, hkv, hd), dtype)
    v = jax.random.normal(kv, (1, seq, hkv, hd), dtype)
    ct = jax.random.normal(kc, (1, seq, hq, hd), dtype)
    seg = None
    if docs:
        seg = jnp.sort(jax.random.randint(ks, (1, seq), 0, docs), axis=1).astype(jnp.int32)
    return q, k, v, ct, seg


def single_device_attention(impl: str, heads: tuple[int, int, int], seq: int):
    """basp_jax.attention on a one-device mesh: the trainer's path (shard_map, kernel choice)."""
    import jax

    from basp_jax import Layout, attention, make_mesh

    layout = Layout.plan(num_devices=1, batch=1, seq_len=seq, num_heads=heads[0],
                         num_kv_heads=heads[1], mode="basp")
    mesh = make_mesh(layout, jax.devices()[:1])

    def fn(q, k, v, seg):
        return attention(q, k, v, mesh=mesh, causal=True, segment_ids=seg, impl=impl)

    return fn


def loss_and_grads(fn):
    import jax
    import jax.numpy as jnp

    def loss(q, k, v, ct, seg):
        out = fn(q, k, v, seg)
        return jnp.sum(out.astype(jnp.float32) * ct.astype(jnp.float32)), out

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))


@functools.cache
def _reference():
    # one jit: its compiles are shared by every kernel and dtype of a shape
    return loss_and_grads(reference_attention)


@functools.cache
def jitted_kernel(impl: str, heads: tuple[int, int, int], seq: int):
    # cached: 4 and 64 documents (only the segment ids' values differ) share one compile
    return loss_and_grads(single_device_attention(impl, heads, seq))


def off_gpu(impl: str, on_gpu: bool) -> str | None:
    """Why `impl` is skipped here: off a GPU, what the kernel's registry entry says of the CPU."""
    from basp_jax.kernels import KERNELS

    why = None if on_gpu else KERNELS.get(impl).supports("cpu", None, None)
    return None if why is None else f"--cpu-smoke: {why}"


def unsupported(impl: str, heads, seq: int, docs: int, dtype: str, on_gpu: bool) -> str | None:
    """Why this case does not run: off a GPU, float16 on the CPU, cuDNN on packed input before
    Hopper or past its head_dim, the Pallas kernel past its head_dim."""
    import jax
    import jax.numpy as jnp

    from basp_jax import cudnn
    from basp_jax.kernels import KERNELS, cudnn_supported, device_capability

    if not on_gpu and dtype == "float16":
        return ("--cpu-smoke: float16 is checked on a GPU only (XLA's CPU backend has no "
                "f16 x f16 -> f32 dot)")
    if why := off_gpu(impl, on_gpu):
        return why
    q = jax.ShapeDtypeStruct((1, seq, heads[0], heads[2]), jnp.dtype(dtype))
    capability = device_capability(jax.devices()[0])
    if impl == "cudnn" and docs and not cudnn.packed_supported(capability):
        return ("packed input before Hopper: auto never runs cudnn there (it would take the "
                "segment mask as a dense S x S bias); pallas does")
    if impl == "cudnn" and not cudnn_supported(q, "gpu", capability):
        return (f"cuDNN flash attention is used for head_dim <= 128 (256 on Hopper and newer), "
                f"a multiple of 8 (basp_jax.kernels.cudnn_supported); auto runs pallas at "
                f"{heads[2]}")
    return KERNELS.get(impl).accepts(q, seq)


def _errors(got, want) -> dict[str, float]:
    """Relative errors (max |x - ref| / max |ref|) of the output and dq, dk, dv."""
    import jax.numpy as jnp

    (_, out), grads = got
    (_, ref), ref_grads = want

    def rel(x, r):
        return float(jnp.max(jnp.abs(x.astype(jnp.float32) - r)) / jnp.max(jnp.abs(r)))

    errors = {"out": rel(out, ref)}
    errors.update({f"d{n}": rel(g, r) for n, g, r in zip("qkv", grads, ref_grads)})
    return errors


def _against_reference(run, heads, seq: int, docs: int, dtype: str, shapes: Shapes) -> dict:
    """run(q, k, v, ct, seg) -> ((loss, out), grads) against the reference on the same inputs
    (rounded to `dtype`, then float32)."""
    import jax.numpy as jnp

    q, k, v, ct, seg = inputs(heads, seq, docs, jnp.dtype(dtype))
    want = _reference()(*(x.astype(jnp.float32) for x in (q, k, v, ct)), seg)
    errors = _errors(run(q, k, v, ct, seg), want)
    bound = shapes.tolerance[dtype]
    ok = max(errors.values()) <= bound
    print(f"  {'ok' if ok else 'FAILED'}: " + "  ".join(f"{n} {e:.1e}" for n, e in errors.items())
          + f"  (bound {bound:.0e})", flush=True)
    return {"status": "ok" if ok else "failed", "errors": errors, "tolerance": bound,
            "seq_len": seq, "dtype": dtype, "heads": heads[0], "kv_heads": heads[1],
            "head_dim": heads[2], "documents": docs}


def check_kernel(impl: str, heads, docs: int, dtype: str, shapes: Shapes, on_gpu: bool) -> dict:
    if why := unsupported(impl, heads, shapes.check_seq, docs, dtype, on_gpu):
        return skip(why)
    seq = shapes.check_seq
    return _against_reference(jitted_kernel(impl, heads, seq), heads, seq, docs, dtype, shapes)


def kernel_cases(shapes: Shapes):
    """(name, impl, heads, documents, dtype) of every correctness case."""
    from basp_jax.kernels import KERNELS

    for heads in shapes.check_heads:
        for dtype in shapes.check_dtypes:
            for docs in shapes.documents:
                for impl in KERNELS:
                    yield (f"{impl}, head_dim {heads[2]}, {packing(docs)}, {dtype}", impl, heads,
                           docs, dtype)


# ---------------------------------------------------------------------------- a ring of 2

def ring_cases(shapes: Shapes):
    """(name, heads, documents, zigzag, dtype, hops): packed zig-zag rings (the trainer's causal
    ring) at both head shapes and dtypes, and one contiguous unpacked ring, each with the hops
    attention() runs (hops "auto": cuDNN's kernels where their masks express the hop, on a GPU
    from sm80) and with our Pallas kernel in every hop ("pallas"; a GPU only). On the CPU the
    packed ring is contiguous too: a zig-zag ring's 4x as many hops take 15 s to compile there
    (its CPU tests: tests/basp_jax/test_attention.py, test_ring_cudnn.py)."""
    first, zigzag = shapes.check_heads[0], not shapes.smoke
    cases = [(first, 0, False, shapes.check_dtypes[0])]
    cases += [(heads, 4, zigzag, dtype) for heads in shapes.check_heads
              for dtype in shapes.check_dtypes]
    for hops in ("auto", "pallas"):
        for heads, docs, zigzag, dtype in cases:
            name = (f"ring 2, {hops} hops, head_dim {heads[2]}, {packing(docs)}, "
                    f"{'zig-zag' if zigzag else 'contiguous'}, {dtype}")
            yield name, heads, docs, zigzag, dtype, hops


def ring_of_two(seq: int, zigzag: bool, hop_kernel, block_size: int):
    """Causal attention as a ring of 2 computes it, on one device: each rank's query chunk
    against the k/v chunks it holds at each step, through ring.py's own attention (its hop
    kernels, log-sum-exp merges and backward pass). One GPU cannot run the hops' ppermutes
    (the CPU tests do: tests/basp_jax/test_flash.py); the kernels are what a GPU must check."""
    import jax.numpy as jnp
    import numpy as np

    from basp_jax import ring as ring_mod
    from basp_jax.layout import zigzag_order

    ring = 2
    order = zigzag_order(seq, ring) if zigzag else np.arange(seq)
    inverse, chunk = np.argsort(order), seq // ring
    static = ring_mod._Ring(ring, zigzag, True, block_size, hop_kernel)

    def fn(q, k, v, seg):
        q, k, v = (x[:, order] for x in (q, k, v))
        seg = None if seg is None else seg[:, order]  # all-gathered, as the ring sees it
        piece = lambda x, r: x[:, r * chunk:(r + 1) * chunk]  # noqa: E731
        outs = []
        for rank in range(ring):
            held = [(rank - step) % ring for step in range(ring)]  # whose chunk, per step
            outs.append(ring_mod._ring_attention(
                piece(q, rank), tuple(piece(k, c) for c in held), tuple(piece(v, c) for c in held),
                seg, jnp.int32(rank), static))
        return jnp.concatenate(outs, axis=1)[:, inverse]

    return fn


def check_ring(heads, docs: int, zigzag: bool, dtype: str, hops: str, shapes: Shapes,
               on_gpu: bool) -> dict:
    import jax
    import jax.numpy as jnp

    from basp_jax.kernels import device_capability, ring_hop_kernel

    if not on_gpu and dtype == "float16":
        return skip("--cpu-smoke: float16 is checked on a GPU only")
    if not on_gpu and hops == "pallas":
        return skip("--cpu-smoke: the Pallas hops in interpret mode take a minute "
                    "(tests/basp_jax/test_flash.py)")
    # the hops attention() runs here (basp_jax.ring_hops): on a GPU from sm80 cuDNN's where its
    # masks express a hop and our Pallas kernel elsewhere ("auto"), or Pallas in every hop; on
    # the CPU the blockwise kernel
    hop = ring_hop_kernel(hops, "gpu" if on_gpu else "cpu", device_capability(jax.devices()[0]),
                          heads[2], shapes.block_size, jnp.dtype(dtype))
    fn = ring_of_two(shapes.check_seq, zigzag, hop, shapes.block_size)
    out = _against_reference(loss_and_grads(fn), heads, shapes.check_seq, docs, dtype, shapes)
    out.update(ring=2, zigzag=zigzag, hop_kernel=hop.name)
    return out
