"""Ways to read a sparse layer's selected pages with XLA on this CPU, side by side: each computes
the same attention output (checked against the reference to float tolerance) from the same cache
and selection, and is timed in one interleaved run with the dense read of the same cache and a
plain streaming read of the selected bytes (what the memory gives: the roofline of the read).

  python experiments/sparse_read_layouts.py --config=configs/sparse_read_layouts.py \\
      [--config.out=docs/results/decode_profile_layouts.json]

The shapes are one layer of the real LM at the decode profile's setting
(experiments/profile_decode.py: SmolLM2-135M, 3 KV heads of 64, 3 query heads a KV head, batch 16,
8K cached tokens, 67 pages of 16 selected a (row, head)); random keys, values and selections
(what a read costs does not depend on them). The process runs as two CPU devices (one a core), so
that the last rows can split the rows over the cores; every other row runs on one device, whose
ops XLA may still spread over both cores.
"""

import functools
import os

os.environ["XLA_FLAGS"] = (
  os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
).strip()

from absl import app, flags  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402
from ml_collections import config_flags  # noqa: E402
import numpy as np  # noqa: E402

from experiments.timing import median_seconds  # noqa: E402
from sparrow_jax import records  # noqa: E402
from sparrow_jax.attention import reference  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", None, "configs/sparse_read_layouts.py")
flags.mark_flags_as_required(["config"])


def _rows(q_BKGE, idx_BKN, P):
  """Per (row, head): the query, the page ids into the flat [B*K*P] pages, the logical ids."""
  B, K, G, E = q_BKGE.shape
  N = idx_BKN.shape[2]
  flat_BKN = idx_BKN + (jnp.arange(B * K, dtype=jnp.int32) * P).reshape(B, K, 1)
  return q_BKGE.reshape(B * K, G, E), flat_BKN.reshape(B * K, N), idx_BKN.reshape(B * K, N)


def _attend(q_aGE, k_aTE, v_aTE, logical_aN, length_a, Z):
  """Softmax attention over gathered pages (the reference's masking, every page valid)."""
  N = logical_aN.shape[-1]
  s = jnp.einsum("...ge,...te->...gt", q_aGE, k_aTE) / np.sqrt(q_aGE.shape[-1])
  pos = (logical_aN[..., :, None] * Z + jnp.arange(Z)).reshape(*logical_aN.shape[:-1], N * Z)
  return reference._softmax_av(s, pos < length_a[..., None], v_aTE)


def batched_gather(q_BKGE, k_BKSE, v_BKSE, idx_BKN, lengths_B):
  """Every (row, head)'s pages gathered in one op, then one batched attention (the gathered
  copy is written and re-read out of cache)."""
  B, K, S, E = k_BKSE.shape
  Z = 16
  P, N = S // Z, idx_BKN.shape[2]
  pick = lambda c: jnp.take_along_axis(
    c.reshape(B, K, P, Z, E), idx_BKN[..., None, None], axis=2, mode="clip"
  ).reshape(B, K, N * Z, E)
  return _attend(q_BKGE, pick(k_BKSE), pick(v_BKSE), idx_BKN, lengths_B[:, None], Z)


def map_over_rows(q_BKGE, k_BKSE, v_BKSE, idx_BKN, lengths_B):
  """A loop over rows, each gathering its K heads' pages (16 iterations of 3 heads)."""
  B, K, S, E = k_BKSE.shape
  Z = 16
  P, N = S // Z, idx_BKN.shape[2]

  def row(r):
    q_KGE, k_KSE, v_KSE, i_KN, length = r
    pick = lambda c: jnp.take_along_axis(
      c.reshape(K, P, Z, E), i_KN[..., None, None], axis=1, mode="clip"
    ).reshape(K, N * Z, E)
    return _attend(q_KGE, pick(k_KSE), pick(v_KSE), i_KN, jnp.full((K,), length), Z)

  return jax.lax.map(row, (q_BKGE, k_BKSE, v_BKSE, idx_BKN, lengths_B))


def kv_together(q_BKGE, kv_XZF, idx_BKN, lengths_B):
  """Each (page, head) block holds its keys and values side by side ([.., Z, 2E]): one gather a
  (row, head) instead of two."""
  B, K, G, E = q_BKGE.shape
  q_aGE, flat_aN, logical_aN = _rows(q_BKGE, idx_BKN, kv_XZF.shape[0] // (B * K))
  length_a = jnp.repeat(lengths_B, K)

  def row(r):
    q_GE, i_N, l_N, length = r
    kv_TF = kv_XZF.at[i_N].get(mode="clip").reshape(-1, 2 * E)
    return _attend(q_GE, kv_TF[:, :E], kv_TF[:, E:], l_N, length, kv_XZF.shape[1])

  return jax.lax.map(row, (q_aGE, flat_aN, logical_aN, length_a)).reshape(B, K, G, E)


def hinted_take(q_BKGE, k_BKSE, v_BKSE, idx_BKN, lengths_B, batch_size=None):
  """The reference's loop over (row, head), its gather a take told the ids are sorted and
  distinct; with batch_size, that many (row, head)s vectorised an iteration."""
  B, K, S, E = k_BKSE.shape
  Z = 16
  P = S // Z
  k_XZE, v_XZE = k_BKSE.reshape(B * K * P, Z, E), v_BKSE.reshape(B * K * P, Z, E)
  q_aGE, flat_aN, logical_aN = _rows(q_BKGE, idx_BKN, P)
  take = lambda c, i: jnp.take(
    c, i, axis=0, mode="clip", unique_indices=True, indices_are_sorted=True
  ).reshape(-1, E)

  def row(r):
    q_GE, i_N, l_N, length = r
    return _attend(q_GE, take(k_XZE, i_N), take(v_XZE, i_N), l_N, length, Z)

  rows = (q_aGE, flat_aN, logical_aN, jnp.repeat(lengths_B, K))
  return jax.lax.map(row, rows, batch_size=batch_size).reshape(B, K, -1, E)


def stream(k_aTE, v_aTE):
  """A plain read of the selected pages' bytes laid end to end (no gather, no attention)."""
  return jnp.sum(k_aTE, axis=(1, 2)) + jnp.sum(v_aTE, axis=(1, 2))


def compare(config) -> dict:
  B, K, G, E, Z, N = config.batch, config.kv_heads, config.group, config.head_dim, 16, config.pages
  S = config.context + Z  # the decode token's page too
  P = S // Z
  rng = np.random.default_rng(0)
  k = jnp.asarray(rng.standard_normal((B, K, S, E), np.float32))
  v = jnp.asarray(rng.standard_normal((B, K, S, E), np.float32))
  q = jnp.asarray(rng.standard_normal((B, K, G, E), np.float32))
  lengths = jnp.full((B,), config.context + 1, jnp.int32)
  idx_np = np.stack([np.sort(rng.choice(P, N, replace=False)) for _ in range(B * K)])
  idx = jnp.asarray(idx_np.reshape(B, K, N), jnp.int32)
  n_valid = jnp.full((B, K), N, jnp.int32)
  kv = jnp.concatenate([k.reshape(B * K * P, Z, E), v.reshape(B * K * P, Z, E)], axis=-1)
  mesh = jax.make_mesh((2,), ("rows",))
  on_cores = lambda x: jax.device_put(x, NamedSharding(mesh, PartitionSpec("rows")))
  over_cores = lambda fn, n: jax.jit(
    jax.shard_map(
      fn,
      mesh=mesh,
      in_specs=(PartitionSpec("rows"),) * n,
      out_specs=PartitionSpec("rows"),
      check_vma=False,
    )
  )
  sparse_ref = functools.partial(reference.sparse_decode_attention, page_size=Z)
  q2, k2, v2, idx2, n2, len2 = (on_cores(x) for x in (q, k, v, idx, n_valid, lengths))
  variants = {
    "reference: loop over (row, head), gather, dot (the sampler's)": (
      jax.jit(sparse_ref),
      (q, k, v, idx, n_valid, lengths),
    ),
    "one batched gather of every row's pages": (jax.jit(batched_gather), (q, k, v, idx, lengths)),
    "loop over rows, the heads' pages gathered together": (
      jax.jit(map_over_rows),
      (q, k, v, idx, lengths),
    ),
    "keys and values in one block a (page, head)": (jax.jit(kv_together), (q, kv, idx, lengths)),
    # (a hint the sampler cannot give: its padding ids repeat valid ones, after them)
    "gather told its ids are sorted and distinct": (jax.jit(hinted_take), (q, k, v, idx, lengths)),
    "4 (row, head)s vectorised an iteration": (
      jax.jit(functools.partial(hinted_take, batch_size=4)),
      (q, k, v, idx, lengths),
    ),
    "reference, rows split over the 2 cores (2 devices)": (
      over_cores(sparse_ref, 6),
      (q2, k2, v2, idx2, n2, len2),
    ),
  }
  expected = np.asarray(jax.jit(sparse_ref)(q, k, v, idx, n_valid, lengths))
  for name, (fn, args) in variants.items():
    np.testing.assert_allclose(np.asarray(fn(*args)), expected, rtol=1e-4, atol=1e-5, err_msg=name)
  others = {
    "dense: the whole cache, one batched einsum (the dense layers')": (
      jax.jit(reference.dense_decode_attention),
      (q, k, v, lengths),
    ),
    "dense, rows split over the 2 cores (2 devices)": (
      over_cores(reference.dense_decode_attention, 4),
      (q2, k2, v2, len2),
    ),
    "stream: a sum over the same bytes laid end to end (no gather, no attention)": (
      jax.jit(stream),
      tuple(jnp.array(c[:, :, : N * Z].reshape(B * K, N * Z, E)) for c in (k, v)),
    ),
  }
  timed = {**variants, **others}
  seconds = median_seconds(
    [lambda fn=fn, args=args: jax.block_until_ready(fn(*args)) for fn, args in timed.values()],
    config.runs,
  )
  sparse_bytes = 2 * B * K * N * Z * E * 4
  dense_bytes = 2 * B * K * (config.context + 1) * E * 4
  rows = []
  for name, s in zip(timed, seconds):
    nbytes = dense_bytes if name.startswith("dense") else sparse_bytes
    rows.append(dict(layout=name, ms=s * 1e3, gbs=nbytes / s / 1e9, mb=nbytes / 1e6))
  print(
    f"one sparse layer's page reads: batch {B}, {K} KV heads x {G} queries, head dim {E}, "
    f"{config.context} cached tokens, {N} pages of {Z} a (row, head) read; median of "
    f"{config.runs} interleaved calls"
  )
  for r in rows:
    print(f"  {r['ms']:7.2f} ms {r['gbs']:6.1f} GB/s of {r['mb']:6.1f} MB  {r['layout']}")
  return dict(rows=rows)


def main(argv):
  del argv
  config = _CONFIG.value
  figures = compare(config)
  if config.out:
    records.write_record(
      os.path.join(records.ROOT, config.out), dict(config=config.to_dict(), **figures)
    )
    print(f"wrote {config.out}")


if __name__ == "__main__":
  app.run(main)
