"""The fused train step at the full row length vs with `rl.length_buckets`, timed side by side.

  python experiments/bench_train_step.py --config=configs/bench_train_step.py \\
      [--config.out=docs/results/train_step_buckets.json]

One batch of `prompts x group_size` rows: random prompts of `prompt` tokens and random completions
whose lengths are long-tailed as RL rollouts are (geometric with mean cutoff / 2, capped at the
cutoff: bench_engine's `long_tail_lengths`), sampled sparsely (the paper's table; the step's
exact-acceptance pass runs the sparse policy), DistillSparse off as in the paper's main runs. Both
settings run the same step on the same rows, interleaved call by call (the machine's load falls on
both alike); the figures are the median seconds per step and completion tokens per second, and the
bucket each micro-batch ran at (the step's own rule, `accumulation.bucket_lengths`).
"""

import os

from absl import app, flags
import jax
import jax.numpy as jnp
from ml_collections import config_flags
import numpy as np
import optax

from experiments.bench_engine import engine_model, long_tail_lengths
from experiments.timing import median_seconds
import sparrow_jax as sj
from sparrow_jax import records
from sparrow_jax.rl import accumulation, step_schema
from sparrow_jax.rl import train_step as ts
from sparrow_jax.rollout import sampler
from sparrow_jax.sparsity.schedule import BudgetTable, KVSchedule

PAGE = 16


def make_batch(c, cfg) -> step_schema.Batch:
  """The rows: random prompt and completion tokens, long-tailed completion lengths."""
  rows, S = c.prompts * c.group_size, c.prompt + c.cutoff
  rng = np.random.default_rng(c.seed)
  lengths_B = long_tail_lengths(rows, c.cutoff, c.seed)
  pos_BS = np.arange(S)[None]
  gen_mask = (pos_BS >= c.prompt) & (pos_BS < c.prompt + lengths_B[:, None])
  return step_schema.Batch(
    tokens=jnp.asarray(rng.integers(1, cfg.vocab_size, (rows, S)), jnp.int32),
    gen_mask=jnp.asarray(gen_mask),
    prompt_len=jnp.full((rows,), c.prompt, jnp.int32),
    logp_rollout=jnp.asarray(np.where(gen_mask, -np.log(cfg.vocab_size), 0.0), jnp.float32),
    rewards=jnp.asarray(rng.integers(0, 2, rows), jnp.float32),
  )


def micro_batch_buckets(c, batch) -> list:
  """The bucket each micro-batch runs at: rows sorted by length, in consecutive slices."""
  lengths = accumulation.bucket_lengths(tuple(c.length_buckets), batch.tokens.shape[1])
  ends = np.sort(np.asarray(step_schema.row_ends(batch)))
  parts = ends.reshape(c.num_minibatches * c.micro_batches, -1).max(1)
  return [int(lengths[np.searchsorted(lengths, end)]) for end in parts]


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}: settings go in --config.FIELD=VALUE")
  c = flags.FLAGS.config
  cfg = engine_model(c)
  params = sj.init_params(cfg, jax.random.PRNGKey(0), std=0.02)
  sparse = sj.SparseConfig(page_size=PAGE, dense_layers=c.dense_layers)
  schedule = KVSchedule.paper("qwen3-1.7b", c.tau)
  batch = make_batch(c, cfg)
  S = batch.tokens.shape[1]
  budget = BudgetTable(jnp.asarray(sampler.budget_table(schedule, S, sparse)))
  optimizer = optax.adamw(1e-6)
  settings = {"full": (), "bucketed": tuple(c.length_buckets)}
  steps = {}
  for name, buckets in settings.items():
    sc = step_schema.StepConfig(
      rl=step_schema.RLConfig(
        num_minibatches=c.num_minibatches, micro_batches=c.micro_batches, length_buckets=buckets
      ),
      distill=step_schema.DistillConfig(enabled=False),
      rollout=step_schema.RolloutConfig(group_size=c.group_size, page_size=PAGE),
    )
    steps[name] = ts.make_train_step(cfg, sc, optimizer, sparse=sparse)
  # Each setting steps its own state (donated), so no call copies one inside the clock.
  states = {
    name: step_schema.init_state(jax.tree_util.tree_map(jnp.copy, params), optimizer)
    for name in steps
  }

  def call(name):
    def run():
      states[name], metrics = steps[name](states[name], batch, budget)
      jax.block_until_ready(metrics)

    return run

  medians = median_seconds([call(name) for name in settings], c.runs)  # a warm-up call first
  times = {}
  tokens = int(np.sum(np.asarray(batch.gen_mask)))
  print(
    f"train step, {cfg.num_hidden_layers} layers, width {cfg.hidden_size}, vocab {cfg.vocab_size}"
    f" ({c.model} shape, random weights); {c.prompts * c.group_size} rows of {S} tokens (prompt "
    f"{c.prompt}), {tokens} completion tokens; {c.num_minibatches} update(s) x "
    f"{c.micro_batches} micro-batches; micro-batch buckets {micro_batch_buckets(c, batch)}"
  )
  for name, seconds in zip(settings, medians):
    times[name] = dict(seconds=seconds, tokens_per_s=tokens / seconds)
    print(f"  {name:>9}: {seconds:.3f} s a step, {tokens / seconds:,.0f} completion tokens/s")
  speedup = times["full"]["seconds"] / times["bucketed"]["seconds"]
  print(f"  bucketed / full speed: {speedup:.2f}x")
  if c.out:
    results = dict(
      config=c.to_dict(),
      times=times,
      speedup=speedup,
      micro_batch_buckets=micro_batch_buckets(c, batch),
      completion_tokens=tokens,
      model=dict(layers=cfg.num_hidden_layers, width=cfg.hidden_size, vocab=cfg.vocab_size),
    )
    records.write_record(os.path.join(records.ROOT, c.out), results)
    print(f"    record: {c.out}")


if __name__ == "__main__":
  config_flags.DEFINE_config_file("config", "configs/bench_train_step.py", "experiment config")
  app.run(main)
