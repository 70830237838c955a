"""Pretrains the embedded default model: a tiny Qwen3 on the pointer-chasing task, on a CPU.

  nice -n 10 python experiments/pretrain_tiny.py --config=configs/pretrain_tiny.py \
      [--config.export_dir=assets/pointer_chase_tiny]

Teacher-forced next-token loss on the response tokens only (the prompt's table is random, so there
is nothing to learn from predicting it). Problems are packed into fixed rows with a per-problem
attention mask and positions restarting at 0, one compiled shape per curriculum level
(config.levels): the run starts on 1..4-hop tables and moves up a level (to 128 hops) each time the
lookup accuracy on the current one reaches config.promote_acc, replaying the lower levels on every
other step. Small batches: many cheap updates beat few big ones for this model.

Resumable: every config.ckpt_minutes the params, optimizer state and loop state (step, level,
curves) go to an orbax checkpoint in <workdir>/checkpoints (sparrow_jax.checkpoint), and the Hugging
Face export is refreshed in <workdir>/hf; rerunning the same command resumes. The data of step s is
a pure function of (config.seed, s), so a resumed run sees the same batches. Metrics go to
<workdir>/tensorboard and <workdir>/metrics.jsonl (sparrow_jax.logging.MetricsLogger).
config.export_dir receives the final model (config.json, model.safetensors, tokenizer.json,
tokenizer_config.json, generation_config.json) and pretrain_log.json, e.g.
assets/pointer_chase_tiny.
"""

import json
import os
import time

from absl import app, flags, logging
import jax
import jax.numpy as jnp
from ml_collections import config_flags
import numpy as np
import optax

import sparrow_jax as sj
from sparrow_jax import checkpoint
from sparrow_jax.attention import reference
from sparrow_jax.data import synthetic
from sparrow_jax.data.tokenizer import (
  IM_END,
  THINK_CLOSE,
  THINK_OPEN,
  TOOL_CALL_CLOSE,
  TOOL_CALL_OPEN,
  TOOL_RESPONSE_CLOSE,
  TOOL_RESPONSE_OPEN,
  Tokenizer,
  save_tokenizer,
  train_bpe,
)
from sparrow_jax.envs import protocol, registry
from sparrow_jax.logging import MetricsLogger
from sparrow_jax.mismatch import cost_model


def model_config(c, vocab_size: int | None = None) -> sj.Qwen3Config:
  """The model of config `c` over `vocab_size` tokens (None: the synthetic task's vocabulary)."""
  vocab_size = len(synthetic.vocab()) if vocab_size is None else vocab_size
  return sj.Qwen3Config(vocab_size=vocab_size, **c.arch.to_dict())


def step_level(step: int, level: int) -> int:
  """Even steps train the current level, odd steps replay the lower ones in turn."""
  if level == 0 or step % 2 == 0:
    return level
  return (step // 2) % level


def pack_batch(levels, seed: int, step: int, level: int, scale: int = 1):
  """Packs freshly sampled problems of curriculum `level` (of config.levels) into its rows (rows x
  `scale`).

  Returns int32 tokens, segment ids (0 = padding), positions, float32 loss weights (1 where the next
  token is a response token of the same problem) and the subset of weights on lookup targets (the
  value of each hop: the far-back retrievals), all [rows, row_len].
  """
  min_hops, max_hops, row_len, rows = levels[level]
  task = synthetic.PointerChase(min_hops=min_hops, max_hops=max_hops)
  rows *= scale
  rng = np.random.default_rng([seed, step])
  out = {
    name: np.zeros((rows, row_len), dt)
    for name, dt in (
      ("tokens", np.int32),
      ("segments", np.int32),
      ("positions", np.int32),
      ("weights", np.float32),
      ("lookups", np.float32),
    )
  }
  problem = task.sample(1, rng)[0]
  for r in range(rows):
    used, seg = 0, 0
    while True:
      ids = list(problem.prompt_ids) + list(problem.reference_ids)
      if used + len(ids) > row_len:
        break
      seg += 1
      n_prompt, span = len(problem.prompt_ids), slice(used, used + len(ids))
      out["tokens"][r, span] = ids
      out["segments"][r, span] = seg
      out["positions"][r, span] = np.arange(len(ids))
      # Position t predicts token t + 1: response tokens are at offsets n_prompt .. len(ids) - 1.
      out["weights"][r, used + n_prompt - 1 : used + len(ids) - 1] = 1.0
      lookup_offsets = n_prompt + 3 * np.arange(problem.num_steps) + 1
      out["lookups"][r, used + lookup_offsets - 1] = 1.0
      used += len(ids)
      problem = task.sample(1, rng)[0]
  return out


def loss_fn(params, batch, cfg):
  seg_BT = batch["segments"]
  same_BTS = (seg_BT[:, :, None] == seg_BT[:, None, :]) & (seg_BT[:, None, :] > 0)

  causal_TT = jnp.tril(jnp.ones((seg_BT.shape[1],) * 2, bool))

  def attention_fn(layer, q, k, v, mask_BT):  # packed documents: causal within each document
    return reference.dense_attention(q, k, v, causal_TT & same_BTS)

  logits_BTV = sj.forward(
    params,
    batch["tokens"],
    cfg,
    positions_BT=batch["positions"],
    mask_BT=seg_BT > 0,
    attention_fn=attention_fn,
  )
  targets_BT = jnp.roll(batch["tokens"], -1, axis=1)
  logp_BT = sj.token_logprobs(logits_BTV, targets_BT)
  w_BT = batch["weights"]
  loss = -jnp.sum(logp_BT * w_BT) / jnp.maximum(jnp.sum(w_BT), 1.0)
  right_BT = (jnp.argmax(logits_BTV, axis=-1) == targets_BT).astype(jnp.float32)
  lk_BT = batch["lookups"]
  metrics = {
    "loss": loss,
    "token_acc": jnp.sum(right_BT * w_BT) / jnp.maximum(jnp.sum(w_BT), 1.0),
    "lookup_acc": jnp.sum(right_BT * lk_BT) / jnp.maximum(jnp.sum(lk_BT), 1.0),
    "lookup_nll": -jnp.sum(logp_BT * lk_BT) / jnp.maximum(jnp.sum(lk_BT), 1.0),
  }
  return loss, metrics


def make_optimizer(c):
  lr, steps = c.learning_rate, c.total_steps
  decay_start = int(steps * (1 - c.decay_frac))
  schedule = optax.join_schedules(
    [
      optax.linear_schedule(0.0, lr, c.warmup_steps),
      optax.constant_schedule(lr),
      optax.linear_schedule(lr, lr * 0.1, max(steps - decay_start, 1)),
    ],
    [c.warmup_steps, decay_start],
  )
  return optax.chain(
    optax.clip_by_global_norm(1.0), optax.adamw(schedule, b1=0.9, b2=0.98, weight_decay=0.01)
  ), schedule


def export(directory, cfg, params):
  """A Hugging Face model dir that sj.load_hf, load_tokenizer and transformers load."""
  eos = synthetic.SPECIAL_TOKENS.index(synthetic.IM_END)
  pad = synthetic.SPECIAL_TOKENS.index(synthetic.EOT)
  sj.save_hf(
    directory,
    cfg,
    params,
    generation_config={
      "eos_token_id": [eos],
      "pad_token_id": pad,
      "do_sample": True,
      "temperature": 1.0,
      "max_new_tokens": synthetic.PointerChase().max_response_len,
    },
  )
  synthetic.save_tokenizer(directory)


class Chains:
  """The synthetic pointer-chasing task's problems (config.corpus = synthetic:pointer_chase): the
  embedded default's corpus and vocabulary."""

  vocab_size = len(synthetic.vocab())

  def __init__(self, c):
    self.c = c

  def pack(self, step: int, level: int) -> dict:
    return pack_batch(self.c.levels, self.c.seed, step, level, self.c.batch_scale)

  def export(self, directory, cfg, params) -> None:
    export(directory, cfg, params)


class Episodes:
  """Reference episodes of a multi-turn environment (config.corpus = env:NAME, its fields in
  config.env; a level's hop range sets its `hops`): the prompt in Qwen3's tool template, each
  reference turn, the tool's observation, then the answer, packed like Chains' problems and trained
  on the model's turns only (observations are context, as in RL). Lookup targets: the turns' tokens
  holding digits (the keys copied out of an observation). Its vocabulary: a byte-level BPE of
  config.vocab_size trained on config.bpe_episodes episodes, the template's tags and
  config.whole_tokens a token each."""

  TAGS = (
    THINK_OPEN,
    THINK_CLOSE,
    TOOL_CALL_OPEN,
    TOOL_CALL_CLOSE,
    TOOL_RESPONSE_OPEN,
    TOOL_RESPONSE_CLOSE,
  )

  def __init__(self, c):
    self.c, self.fields = c, {k: v for k, v in c.env.items() if k != "tool_workers"}
    hops = max(level[1] for level in c.levels)
    texts = [self.episode(hops, p).text for p in range(c.bpe_episodes)]
    self.tok = train_bpe(texts, c.vocab_size, [*self.TAGS, *c.whole_tokens])
    self.tokenizer = Tokenizer(self.tok, (self.tok.token_to_id(IM_END),), 0)
    self.vocab_size = self.tokenizer.vocab_size
    pieces = [self.tokenizer.decode([i]) for i in range(self.vocab_size)]
    self.has_digit = np.asarray([any(ch.isdigit() for ch in p) for p in pieces])

  def episode(self, hops: int, position: int, tokenizer=None):
    """The reference episode of problem `position` of the env with `hops` hops (a Transcript)."""
    env = registry.make_env(self.c.corpus, **{**self.fields, "hops": hops})
    problem = env.sample(1, position)[0]
    actions = [a + IM_END for a in env.reference_actions(problem)]
    return protocol.replay(env, problem, actions, tokenizer)

  def pack(self, step: int, level: int) -> dict:
    """Packed rows as `pack_batch`'s, of episodes drawn from (config.seed, step)."""
    min_hops, max_hops, row_len, rows = self.c.levels[level]
    rng = np.random.default_rng([self.c.seed, step])
    names = ("tokens", "segments", "positions", "weights", "lookups")
    out = {k: np.zeros((rows * self.c.batch_scale, row_len), np.int32) for k in names[:3]}
    out.update({k: np.zeros_like(out["tokens"], np.float32) for k in names[3:]})
    for r in range(len(out["tokens"])):
      used, seg = 0, 0
      while True:
        hops, position = int(rng.integers(min_hops, max_hops + 1)), int(rng.integers(2**40))
        ids, is_action = self.episode(hops, position, self.tokenizer).tokens(self.tokenizer)
        if used + len(ids) > row_len:
          break
        seg, span = seg + 1, slice(used, used + len(ids))
        out["tokens"][r, span], out["segments"][r, span] = ids, seg
        out["positions"][r, span] = np.arange(len(ids))
        # Position t predicts token t + 1: the weight of a target sits one place before it.
        target = np.asarray(is_action[1:] + [False])
        out["weights"][r, span] = target
        out["lookups"][r, span] = target & self.has_digit[np.asarray(ids[1:] + [0])]
        used += len(ids)
    return out

  def export(self, directory, cfg, params) -> None:
    """A model dir as `export`'s, with this corpus's tokenizer."""
    generation = {"eos_token_id": [self.tokenizer.eos_ids[0]], "pad_token_id": 0}
    sj.save_hf(directory, cfg, params, generation_config={**generation, "do_sample": True})
    save_tokenizer(self.tok, directory)


def pretrain(c):
  """Runs (or resumes) the pretraining described by config `c`; returns the loop state."""
  if not c.levels or c.promote_window < 1 or c.log_every < 1:
    raise ValueError(
      f"config.levels must be non-empty and config.promote_window / log_every >= 1; "
      f"got {c.levels}, {c.promote_window}, {c.log_every}"
    )
  corpus = Episodes(c) if c.get("corpus", "").startswith("env:") else Chains(c)
  cfg = model_config(c, corpus.vocab_size)
  params = sj.init_params(cfg, jax.random.PRNGKey(c.seed))
  optimizer, schedule = make_optimizer(c)
  opt_state = optimizer.init(params)
  # level_acc: lookup accuracy of the last promote_window current-level steps, checkpointed so a
  # resumed run promotes at the same step.
  state = {
    "step": 0,
    "elapsed_s": 0.0,
    "level": 0,
    "level_acc": [],
    "promotions": [],
    "history": [],
  }
  mgr = checkpoint.manager(c.workdir, c.keep_checkpoints)
  restored = checkpoint.restore_latest(mgr, {"params": params, "opt_state": opt_state})
  if restored is not None:
    saved, state = restored
    params, opt_state = saved["params"], saved["opt_state"]
    print(
      f"resumed at step {state['step']}, level {state['level']} "
      f"({state['elapsed_s'] / 60:.1f} min trained)",
      flush=True,
    )
  print(f"params {cost_model.param_count(cfg):,}  cfg {cfg}", flush=True)

  @jax.jit
  def train_step(params, opt_state, batch):
    (_, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, batch, cfg)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    metrics["grad_norm"] = optax.global_norm(grads)
    return optax.apply_updates(params, updates), opt_state, metrics

  levels = c.levels
  logger = MetricsLogger(c.workdir, resume_step=state["step"])
  t_last, t_ckpt, window, pending = time.time(), time.time(), [], []
  while state["step"] < c.total_steps:
    step, level = state["step"], state["level"]
    trained = step_level(step, level)
    params, opt_state, metrics = train_step(params, opt_state, corpus.pack(step, trained))
    state["step"] = step = step + 1
    window.append(metrics)
    if trained == level:
      pending.append(metrics["lookup_acc"])  # read back at the log step, not every step
    if step % c.log_every == 0 or step == c.total_steps:
      now = time.time()
      state["elapsed_s"] += now - t_last
      mean = {k: float(np.mean([float(m[k]) for m in window])) for k in window[0]}
      state["level_acc"] = (state["level_acc"] + [float(x) for x in pending])[-c.promote_window :]
      mean["level_lookup_acc"] = float(np.mean(state["level_acc"]))
      window, pending, t_last = [], [], now
      logger.write(
        step,
        {
          **{f"pretrain/{k}": v for k, v in mean.items()},
          "pretrain/level": level,
          "pretrain/lr": float(schedule(step)),
        },
      )
      state["history"].append(
        {
          "step": step,
          "minutes": round(state["elapsed_s"] / 60, 2),
          "level": level,
          **{k: round(v, 4) for k, v in mean.items()},
        }
      )
      print(
        f"step {step:6d}  {state['elapsed_s'] / 60:6.1f} min  level {level} "
        f"(hops {levels[level][0]}-{levels[level][1]})  loss {mean['loss']:.4f}  "
        f"lookup_acc {mean['lookup_acc']:.3f}  level_lookup_acc "
        f"{mean['level_lookup_acc']:.3f}  gnorm {mean['grad_norm']:.2f}",
        flush=True,
      )
      if (
        level + 1 < len(levels)
        and len(state["level_acc"]) == c.promote_window
        and mean["level_lookup_acc"] >= c.promote_acc
      ):
        state["level"] = level + 1
        state["promotions"].append(
          {"step": step, "level": level + 1, "minutes": round(state["elapsed_s"] / 60, 2)}
        )
        state["level_acc"] = []
        print(
          f"-> level {level + 1} (hops {levels[level + 1][0]}-{levels[level + 1][1]})", flush=True
        )
      if c.snapshot_every and step % c.snapshot_every == 0:
        corpus.export(os.path.join(c.workdir, "snapshots", f"step_{step}"), cfg, params)
      if now - t_ckpt > c.ckpt_minutes * 60 or step == c.total_steps:
        checkpoint.save(mgr, step, {"params": params, "opt_state": opt_state}, state)
        corpus.export(os.path.join(c.workdir, "hf"), cfg, params)
        t_ckpt = now
  mgr.wait_until_finished()
  logger.close()
  if c.export_dir:
    corpus.export(c.export_dir, cfg, params)
    history = state["history"]
    with open(os.path.join(c.export_dir, "pretrain_log.json"), "w") as f:
      json.dump(
        {
          "config": c.to_dict(),
          "train_minutes": round(state["elapsed_s"] / 60, 1),
          "promotions": state["promotions"],
          "history": history[:: max(len(history) // 100, 1)] + history[-1:],
        },
        f,
        indent=1,
      )
    print(f"exported to {c.export_dir}", flush=True)
  return state


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}: settings go in --config.FIELD=VALUE")
  logging.set_verbosity(logging.WARNING)  # orbax logs every file it writes at INFO
  pretrain(flags.FLAGS.config)


if __name__ == "__main__":
  # Defined here, not at import: tests import this module beside other scripts defining --config.
  config_flags.DEFINE_config_file("config", "configs/pretrain_tiny.py", "experiment config")
  app.run(main)
