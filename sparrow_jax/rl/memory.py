"""The device-memory model of a training run: the bytes one device holds and the bytes it has,
computed without allocating anything (shapes, shardings and XLA's memory analysis of the train
step lowered from abstract inputs). The checks in rl/run_config.py compare these sizes against the
device before the weights are read or the workdir is written; the model is kept apart from them
so that what a run needs is computed in one place and the checks only decide what to refuse.
"""

import dataclasses
import math
import os
from typing import NamedTuple

import jax
import jax.numpy as jnp

from sparrow_jax.attention import page_pool
from sparrow_jax.rl import rollouts
from sparrow_jax.rollout import engine


def host_memory_bytes() -> int | None:
  """The host's physical memory; None when it is not known."""
  try:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  except (ValueError, OSError):
    return None


def device_memory_bytes(device) -> int | None:
  """What one device can hold: its allocator's limit (GPU, TPU), or on the CPU the host's physical
  memory split over its local devices; None when neither is known."""
  stats = device.memory_stats() if hasattr(device, "memory_stats") else None
  if stats and stats.get("bytes_limit"):
    return int(stats["bytes_limit"])
  host = host_memory_bytes() if device.platform == "cpu" else None
  if not host:
    return None
  return host // max(sum(d.platform == "cpu" for d in jax.local_devices()), 1)


def device_bytes(tree, shardings) -> int:
  """Bytes one device holds of the (abstract) arrays of `tree` laid out by `shardings`."""
  sizes = jax.tree.map(
    lambda x, s: math.prod(s.shard_shape(x.shape)) * x.dtype.itemsize, tree, shardings
  )
  return sum(jax.tree.leaves(sizes))


@dataclasses.dataclass(frozen=True)
class StepMemory:
  """One device's bytes of the compiled train step, from XLA (`memory_analysis()` of the step
  lowered from abstract inputs: nothing allocated): `peak` its arguments, outputs and temporaries
  (activations, gradients, logits chunks) with the donated state counted once; of them `state` the
  train state, of which `lora` the LoRA adapters and their Adam moments, and `metrics` the outputs
  beside the state."""

  peak: int
  state: int
  lora: int
  metrics: int

  @classmethod
  def of(cls, compiled, state, shardings) -> "StepMemory":
    m = compiled.memory_analysis()
    lora = (state.lora, state.lora_opt_state)
    return cls(
      peak=m.argument_size_in_bytes
      + m.output_size_in_bytes
      - m.alias_size_in_bytes
      + m.temp_size_in_bytes,
      state=device_bytes(state, shardings),
      lora=device_bytes(lora, (shardings.lora, shardings.lora_opt_state)),
      metrics=m.output_size_in_bytes - m.alias_size_in_bytes,
    )


def pool_bytes(c, cfg, engine_cfg, sparse) -> int:
  """Bytes of one device's KV page pool: engine_cfg's pages at the model's dtype."""
  score = sparse.page_score if sparse else "mean"
  page = page_pool.page_bytes(cfg, engine.page_size(sparse), jnp.dtype(c.model.dtype), score)
  return engine_cfg.num_pages * page


class Part(NamedTuple):
  """One part of what a device holds: the config field that scales it and its value, what it
  holds, how to make it smaller, and its bytes."""

  field: str
  value: object
  what: str
  fix: str
  size: int


def parts(c, cfg, engine_cfg, step: StepMemory, pool: int) -> dict:
  """What a device holds, by the config fields that scale each part."""
  r = c.rollout
  model_field = "model.hf_dir" if c.model.hf_dir else "model.preset"
  reference = ", and the reference params (rl.kl_coef > 0)" if c.rl.kl_coef > 0 else ""
  # the pool holds a device's share of the groups under way: a step's and partial_groups more
  pool_field, pool_value = (
    "rollout.prompts_per_step",
    f"{r.prompts_per_step} (x group_size {r.group_size})",
  )
  carried = rollouts.AsyncConfig.of(c).partial_groups
  if carried:
    pool_field = "rollout.partial_groups"
    pool_value = (
      f"{carried} (beside prompts_per_step {r.prompts_per_step}, x group_size {r.group_size})"
    )
  if r.pool_gb:
    pool_field, pool_value = "rollout.pool_gb", r.pool_gb
  rows = r.prompts_per_step * r.group_size // (c.rl.num_minibatches * c.rl.micro_batches)
  length = r.max_prompt_len + r.max_new_tokens
  return {
    "lora": Part(
      "distill.rank",
      c.distill.rank,
      "the LoRA adapters and their Adam moments",
      "lower it",
      step.lora,
    ),
    "model": Part(
      model_field,
      c.model[model_field.split(".")[1]],
      f"the params and their Adam moments{reference}, of {cfg.num_hidden_layers} layers, "
      f"hidden_size {cfg.hidden_size}, intermediate_size {cfg.intermediate_size}, vocab_size "
      f"{cfg.vocab_size}",
      "a smaller model, or shard it over more devices (mesh.fsdp, mesh.tensor)",
      step.state - step.lora,
    ),
    "pool": Part(
      pool_field,
      pool_value,
      f"a KV pool of {engine_cfg.num_pages} pages",
      "lower it, or bound the pool with rollout.pool_gb / engine_slots",
      pool,
    ),
    "metrics": Part(
      "stats.num_bins",
      c.stats.num_bins,
      "the step's metrics, some per position bin",
      "lower it",
      step.metrics,
    ),
    "rows": Part(
      "rollout.prompts_per_step / group_size / max_prompt_len / max_new_tokens",
      (r.prompts_per_step, r.group_size, r.max_prompt_len, r.max_new_tokens),
      f"the step's batch, activations, gradients and logits chunks, of {rows} rows a backward "
      f"pass (prompts_per_step x group_size / (rl.num_minibatches x rl.micro_batches)) of "
      f"{length} tokens",
      "fewer or shorter rows a pass: raise rl.micro_batches, lower prompts_per_step, group_size, "
      "the lengths or distill.rank, or add devices on mesh.data",
      step.peak - step.state - step.metrics,
    ),
  }
