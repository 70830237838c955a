"""Row slicing for the train step: minibatches, gradient accumulation over micro-batches and
no-grad passes in slices (each a lax.scan / lax.map holding one slice's activations at a time),
and length buckets (each slice cut to the smallest compiled length that holds its longest row).
The losses' normalisers stay those of the whole batch, so the sum over slices is the whole batch's
loss and gradient."""

import jax
import jax.numpy as jnp

from sparrow_jax import sharding
from sparrow_jax.rl.step_schema import Batch, row_ends


def bucket_lengths(length_buckets, S: int) -> tuple:
  """The row lengths the passes over rows of S tokens compile at: the buckets under S, then S."""
  return tuple(n for n in length_buckets if n < S) + (S,)


def _batch_of(rows):
  return rows if isinstance(rows, Batch) else rows[0]


def in_length_bucket(fn, rows, lengths, *args):
  """fn(rows, *args) -> (out, per_row), run on `rows` (a Batch, or a tuple led by the Batch, of
  per-row arrays; sequence axis 1) cut to the smallest of `lengths` that holds their longest row
  (`row_ends`), per_row's arrays padded back to the full length lengths[-1] with zeros. One
  program: a lax.switch of one branch per length, of which only the chosen one runs."""
  if len(lengths) == 1:
    return fn(rows, *args)
  on_tokens = lambda f: lambda x: f(x) if x.ndim >= 2 else x

  def at_length(n):
    def run(rows, *args):
      cut = jax.tree_util.tree_map(on_tokens(lambda x: x[:, :n]), rows)
      out, per_row = fn(cut, *args)
      pad = lambda x: jnp.pad(x, ((0, 0), (0, lengths[-1] - n)) + ((0, 0),) * (x.ndim - 2))
      return out, jax.tree_util.tree_map(on_tokens(pad), per_row)

    return run

  i = jnp.searchsorted(jnp.asarray(lengths), jnp.max(row_ends(_batch_of(rows))))
  return jax.lax.switch(i, [at_length(n) for n in lengths], rows, *args)


def _by_length(rows, lengths):
  """`rows` sorted by length (`row_ends`) when there are buckets, so that consecutive slices of
  them fit short ones, and a function putting per-row results back in the given order."""
  if len(lengths) == 1:
    return rows, lambda per_row: per_row
  order = jnp.argsort(row_ends(_batch_of(rows)))
  back = jnp.argsort(order)
  take = lambda idx: lambda tree: jax.tree_util.tree_map(lambda x: x[idx] if x.ndim else x, tree)
  return take(order)(rows), take(back)


def accumulated_grad(loss_fn, diff, rows, n: int, loss_agg: str, lengths=None):
  """value_and_grad of loss_fn(diff, rows, weights) -> (loss, aux), summed over n equal slices of
  `rows` (a tuple led by the Batch, of per-row arrays; a lax.scan holds one slice's activations at
  a time). Each slice is weighted by its share of the whole batch's normalisers (tokens for token
  means, rows for the sequence means of `loss_agg`), so the sum is the whole batch's loss and
  gradient. Scalars in aux are summed, per-row arrays put back in row order. lengths
  (`bucket_lengths`): each slice runs `in_length_bucket`, the rows sorted by length first."""
  grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
  lengths = lengths or (rows[0].tokens.shape[1],)

  def bucketed_grad(part, weights):
    (loss, aux), g = grad_fn(diff, part, weights)
    return (loss, g), aux

  if n == 1:
    (loss, grads), aux = in_length_bucket(bucketed_grad, rows, lengths, (1.0, 1.0))
    return (loss, aux), grads
  B = rows[0].gen_mask.shape[0]
  rows, in_row_order = _by_length(rows, lengths)
  parts = _row_slices(rows, n, "micro_batches")
  tokens_n = jnp.sum(parts[0].gen_mask, axis=(1, 2)).astype(jnp.float32)
  token_w_n = tokens_n / jnp.maximum(jnp.sum(tokens_n), 1.0)
  pg_w_n = token_w_n if loss_agg == "token-mean" else jnp.full((n,), 1.0 / n)

  def body(grads, xs):
    part, pg_w, token_w = xs
    (loss, g), aux = in_length_bucket(bucketed_grad, part, lengths, (pg_w, token_w))
    return jax.tree_util.tree_map(lambda a, b: a + b.astype(a.dtype), grads, g), (loss, aux)

  zeros = jax.tree_util.tree_map(lambda x: jnp.zeros(x.shape, jnp.float32), diff)
  grads, (loss_n, aux_n) = jax.lax.scan(body, zeros, (parts, pg_w_n, token_w_n))
  grads = jax.tree_util.tree_map(lambda g, x: g.astype(x.dtype), grads, diff)
  merge = lambda y: jnp.sum(y, 0) if y.ndim == 1 else y.reshape(B, *y.shape[2:])
  return (jnp.sum(loss_n), in_row_order(jax.tree_util.tree_map(merge, aux_n))), grads


def map_row_slices(fn, rows, n: int, lengths=None):
  """fn(rows) -> a pytree of per-row arrays, computed over n equal slices of `rows` (a Batch, or a
  tuple led by the Batch) in turn (a lax.map) and put back in row order: a no-grad pass over the
  whole batch then holds one slice's attention temporaries, as a gradient pass does (the default's
  pre-update passes over 32 rows had set its peak RSS). lengths (`bucket_lengths`): each slice
  runs `in_length_bucket`, the rows sorted by length first."""
  lengths = lengths or (_batch_of(rows).tokens.shape[1],)
  sliced = lambda rows: in_length_bucket(lambda r: ((), fn(r)), rows, lengths)[1]
  if n == 1:
    return sliced(rows)
  rows, in_row_order = _by_length(rows, lengths)
  out = jax.lax.map(sliced, _row_slices(rows, n, "num_minibatches x micro_batches"))
  return in_row_order(jax.tree_util.tree_map(lambda y: y.reshape(-1, *y.shape[2:]), out))


def _row_slices(rows, n: int, field: str):
  """`rows` (a pytree of per-row arrays) as n stacked equal slices of consecutive rows, each slice
  spread over the batch mesh axes."""
  B = jax.tree_util.tree_leaves(rows)[0].shape[0]
  if B % n:
    raise ValueError(f"a batch of {B} rows is not divisible into {field} = {n} slices")
  return _rows(jax.tree_util.tree_map(lambda x: x.reshape(n, B // n, *x.shape[1:]), rows), True)


def minibatches(rows, n):
  """`rows` (a pytree of per-row arrays) as n minibatches of consecutive rows, each spread over the
  batch mesh axes again."""
  B = jax.tree_util.tree_leaves(rows)[0].shape[0]
  if B % n:
    raise ValueError(f"batch of {B} rows is not divisible into num_minibatches={n}")
  parts = jax.tree_util.tree_map(lambda x: x.reshape(n, B // n, *x.shape[1:]), rows)
  return [_rows(jax.tree_util.tree_map(lambda x: x[i], parts)) for i in range(n)]


def _rows(tree, stacked: bool = False):
  """Each array's rows constrained to the batch mesh axes (after a leading stack axis)."""
  lead = ("micro_batch",) if stacked else ()
  return jax.tree_util.tree_map(
    lambda x: sharding.constrain(x, lead + ("batch",) + ("length",) * (x.ndim - len(lead) - 1)),
    tree,
  )
