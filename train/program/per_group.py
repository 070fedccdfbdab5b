"""A train step whose gradients cross hosts once, not once a microbatch.

Under XLA's partitioner a gradient is a global value: each microbatch's gradient is complete
(summed over every device) where the step adds it to the running sum, so with A microbatches
every gradient element crosses hosts A times. Here the step maps the model over the mesh's
'group' axis instead (jax.vmap with spmd_axis_name='group', traced under
basp_jax.mesh.groups_mapped): each group differentiates its own copy of the parameters on
its own rows, so its gradient stays on its devices. The copies' gradients are summed over the
microbatches inside each group, then across the groups once, onto the stored shards.

It runs where each group is one host (the layout's sp equals the devices per host, so the
groups' sums are the hosts') and the parameter strategy holds a host-local copy of the weights
for the step anyway (host; staged_keep, which gathers it across hosts once a step): the copies
are that copy, split over the host's devices, and the price is the float32 sum, split over the
host's devices instead of staged_keep's over all of them. Inside the map the model sees one
group's rows on the same mesh, placed as hsdp places them (the parameters and the vocabulary
split over 'seq', the host's devices).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from basp_jax.mesh import GROUP, SEQ, groups_mapped
from basp_jax.sharding import HOST, LOCAL, ShardingRules, sums_per_host
from models.layers import param_names
from models.transformer import abstract_model, with_values

from .objective import objective

# The placement the model is traced in inside the map: split over the host's devices only.
VIEW_STRATEGY = "hsdp"


def applies(rules: ShardingRules | None, layout, accum: int) -> bool:
    """Whether a step of `accum` microbatches under `rules` on `layout` keeps each host's
    gradient apart until the step ends (see the module's docstring)."""
    return (rules is not None and layout is not None
            and sums_per_host(rules.strategy, layout, accum))


class GroupView:
    """The model as one group traces it (hsdp's placement on the same mesh), and where each
    group's copy of a parameter lives: [groups, ...], the leading axis over 'group'."""

    def __init__(self, parts, config, options):
        view = abstract_model(config, options=options, param_sharding=VIEW_STRATEGY)
        self.graphdef, abs_params, abs_rest = nnx.split(view, nnx.Param, ...)
        self.abstract_state = (abs_params, abs_rest)
        self.rest = parts.rest
        self.mesh = options.mesh
        self.groups = self.mesh.shape[GROUP]
        self.rules = view.options.rules
        self.names = param_names(abs_params)
        self.dtype = options.dtype

    def sharding(self, names, shape) -> NamedSharding:
        """A [groups, *shape] stack of copies: one per group, split inside it as hsdp splits."""
        return NamedSharding(self.mesh, P(GROUP, *self.rules.spec(names, shape)))

    def shardings(self, params):
        return jax.tree.map(lambda x, n: self.sharding(n, x.shape), params, self.names)

    def copies(self, params):
        """Each group's copy of `params`, matrices in the compute dtype (as the layers use
        them: half the bytes to gather and hold), gathered across hosts once."""
        def copy(x, names):
            if x.ndim - (1 if names[0] == "layers" else 0) >= 2:
                x = x.astype(self.dtype)
            stacked = jnp.broadcast_to(x, (self.groups,) + x.shape)
            return jax.lax.with_sharding_constraint(stacked, self.sharding(names, x.shape))

        return jax.tree.map(copy, params, self.names)

    def micro_objective(self, loss_fn):
        """micro_objective(params, tokens, targets, segment_ids) of one group's rows, as
        train.program.step.make_micro_objective's."""
        abs_params, abs_rest = self.abstract_state

        def micro_objective(params, tokens, targets, segment_ids):
            model = nnx.merge(self.graphdef, with_values(abs_params, params),
                              with_values(abs_rest, self.rest))
            return objective(model, tokens, targets, segment_ids, loss_fn)

        return micro_objective

    def rows(self, x):
        """[accum, B, S] -> [accum, groups, B / groups, S], each group's rows on its devices."""
        a, b, s = x.shape
        x = x.reshape(a, self.groups, b // self.groups, s)
        return jax.lax.with_sharding_constraint(
            x, NamedSharding(self.mesh, P(None, GROUP, None, SEQ)))


def accumulate(view: GroupView, grad_fn, params, batch, param_shardings, packed: bool):
    """(float32 gradient sum, loss sum, loss tokens, weighted aux loss sum) of the microbatches
    of `batch` like train.program.step's, each group's sum kept apart over the microbatches and
    summed across the groups once at the end, onto `param_shardings`. grad_fn(params, tokens,
    targets, segment_ids) -> ((loss sum, count, weighted aux loss), gradients): one group's
    microbatch."""
    copies = view.copies(params)
    shardings = view.shardings(params)
    zeros = jax.tree.map(lambda c: jnp.zeros(c.shape, jnp.float32), copies)
    zeros = jax.lax.with_sharding_constraint(zeros, shardings)
    rows = {k: view.rows(v) for k, v in batch.items()}
    per_group = jax.vmap(grad_fn, spmd_axis_name=GROUP)

    def body(carry, micro):
        grad_sum, sums = carry
        segment_ids = micro["segment_ids"] if packed else None
        with groups_mapped():
            terms, grads = per_group(copies, micro["tokens"], micro["targets"], segment_ids)
        grads = jax.lax.with_sharding_constraint(grads, shardings)
        grad_sum = jax.tree.map(lambda a, g: a + g.astype(jnp.float32), grad_sum, grads)
        return (grad_sum, tuple(a + t.sum() for a, t in zip(sums, terms))), None

    init = (zeros, (jnp.zeros((), jnp.float32),) * 3)
    (grad_sum, (loss_sum, count, aux_sum)), _ = jax.lax.scan(body, init, rows)
    # The one reduction across hosts: each group's sum onto the stored shards, in the dtype the
    # layers computed the gradients in (half the bytes under bf16 compute; each microbatch's
    # gradient would otherwise cross in it too), back in float32 after. Not in float16: a sum
    # of scaled microbatch gradients would overflow its range A times sooner (loss scaling).
    def crossing(dtype):
        return jnp.float32 if dtype == jnp.float16 else dtype

    grad_sum = jax.tree.map(
        lambda a, c, n, sh: _sum_across_groups(a.astype(crossing(c.dtype)), view, n, sh).astype(
            jnp.float32), grad_sum, copies, view.names, param_shardings)
    return grad_sum, loss_sum, count, aux_sum


def _sum_across_groups(sums, view: GroupView, names, stored: NamedSharding):
    """The total of [groups, ...] sums, placed on `stored`. Written out as a reduce-scatter
    across the groups where the stored shards are pieces of the groups' (a staged strategy's,
    split over ('local', 'host') on the dimension the view splits over 'seq'), or an all-reduce
    where each host stores its copy (host sharding): XLA's CPU partitioner would otherwise
    all-reduce and slice (twice the bytes of a reduce-scatter). Anything else: XLA's sum."""
    view_spec = tuple(view.rules.spec(names, sums.shape[1:]))
    view_spec += (None,) * (sums.ndim - 1 - len(view_spec))
    stored_spec = tuple(stored.spec) + (None,) * (sums.ndim - 1 - len(stored.spec))
    split = [d for d, entry in enumerate(view_spec) if entry is not None]
    others_whole = all(e is None for d, e in enumerate(stored_spec) if d not in split)
    if split == [] and all(e is None for e in stored_spec):
        scatter, out_spec = None, P()
    elif len(split) == 1 and view_spec[split[0]] == SEQ and others_whole and \
            _axes(stored_spec[split[0]]) in ((LOCAL,), (LOCAL, HOST)):
        d = split[0]
        scatter = d if _axes(stored_spec[d]) == (LOCAL, HOST) else None
        out_spec = P(*((SEQ, GROUP) if scatter is not None and i == d else e
                       for i, e in enumerate(view_spec)))
    else:  # stored split elsewhere than the view (where all the devices do not divide it)
        total = jax.lax.reduce(sums, jnp.zeros((), sums.dtype), jax.lax.add, (0,))
        return jax.lax.with_sharding_constraint(total, stored)

    def local(x):
        x = x[0]
        if scatter is None:
            return jax.lax.psum(x, GROUP)
        return jax.lax.psum_scatter(x, GROUP, scatter_dimension=scatter, tiled=True)

    total = jax.shard_map(local, mesh=view.mesh, in_specs=P(GROUP, *view_spec),
                          out_specs=out_spec)(sums)
    return jax.lax.with_sharding_constraint(total, stored)


def _axes(entry) -> tuple[str, ...]:
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
