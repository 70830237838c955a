"""Pretrains the embedded default model: a tiny Qwen3 on the pointer-chasing task, on a CPU.

  nice -n 10 python experiments/pretrain_tiny.py --workdir runs/pretrain_tiny --steps 3000 \
      --decay_frac 0.2 --export assets/pointer_chase_tiny

Teacher-forced next-token loss on the response tokens only (the prompt's table is random, so there is
nothing to learn from predicting it). Problems are packed into fixed rows with a per-problem attention
mask and positions restarting at 0, one compiled shape per curriculum level (LEVELS below): the run
starts on 1..4-hop tables and moves up a level (to 128 hops) each time the lookup accuracy on the
current one reaches --promote_acc, replaying the lower levels on every other step. Small batches:
many cheap updates beat few big ones for this model.

Resumable: every `--ckpt_minutes` the params, optimizer state and step go to <workdir>/ckpt.npz
(atomically), and the Hugging Face export is refreshed in <workdir>/hf; rerunning the same command
resumes. The data of step s is a pure function of (--seed, s), so a resumed run sees the same batches.
`--export DIR` copies the final model (config.json, model.safetensors, tokenizer.json,
generation_config.json) to DIR, e.g. assets/pointer_chase_tiny.
"""
import argparse
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from tensorboardX import SummaryWriter

import sparrow_jax as sj
from sparrow_jax.data import synthetic
from sparrow_jax.mismatch import cost_model
from sparrow_jax.model import qwen3

# A length curriculum. Level k trains on LEVELS[k] (hop range, row_len, rows: ~2K tokens a step, rows
# short where problems are short so the T^2 attention stays cheap). The lookup (a two-layer circuit:
# layer 0 gathers each entry's key into its `;`, a layer-1 head matches the current key there and
# copies the value; see assets/pointer_chase_tiny/README.md) forms within a few hundred
# updates on 1..4-hop tables but not when long tables dominate the batches (a 5100-step run mixing all
# lengths from step 0 never formed it), so the run moves up a level once the lookup accuracy on the
# current level reaches --promote_acc. Every other step replays a lower level so shorter lengths are
# not forgotten.
LEVELS = (  # (min_hops, max_hops, row_len, rows)
    (1, 4, 64, 32),
    (5, 8, 128, 16),
    (9, 16, 256, 8),
    (17, 32, 256, 8),
    (33, 64, 512, 4),
    (65, 128, 896, 2),
)
EVAL_TASK = synthetic.PointerChase()


def model_config() -> sj.Qwen3Config:
  # Two layers: the lookup needs two (gather each entry into its `;`, then match and copy), and half
  # the depth is twice the updates per CPU-minute; with rollout.dense_layers = 1 the matching layer is
  # the sparse one, so a small KV budget hits exactly the far-back lookups.
  return sj.Qwen3Config(
      vocab_size=len(synthetic.vocab()), hidden_size=128, intermediate_size=384,
      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
      rope_theta=1e6, tie_word_embeddings=True, max_position_embeddings=2048)


def step_level(step: int, level: int) -> int:
  """Even steps train the current level, odd steps replay the lower ones in turn."""
  if level == 0 or step % 2 == 0:
    return level
  return (step // 2) % level


def pack_batch(seed: int, step: int, level: int, scale: int = 1):
  """Packs freshly sampled problems of curriculum `level` into its rows (rows x `scale`).

  Returns int32 tokens, segment ids (0 = padding), positions, float32 loss weights (1 where the next
  token is a response token of the same problem) and the subset of weights on lookup targets (the
  value of each hop: the far-back retrievals), all [rows, row_len].
  """
  min_hops, max_hops, row_len, rows = LEVELS[level]
  task = synthetic.PointerChase(min_hops=min_hops, max_hops=max_hops)
  rows *= scale
  rng = np.random.default_rng([seed, step])
  out = {name: np.zeros((rows, row_len), dt) for name, dt in (
      ("tokens", np.int32), ("segments", np.int32), ("positions", np.int32),
      ("weights", np.float32), ("lookups", np.float32))}
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
      out["weights"][r, used + n_prompt - 1:used + len(ids) - 1] = 1.0
      lookup_offsets = n_prompt + 3 * np.arange(problem.num_steps) + 1
      out["lookups"][r, used + lookup_offsets - 1] = 1.0
      used += len(ids)
      problem = task.sample(1, rng)[0]
  return out


def loss_fn(params, batch, cfg):
  seg_BT = batch["segments"]
  same_BTS = (seg_BT[:, :, None] == seg_BT[:, None, :]) & (seg_BT[:, None, :] > 0)

  def attention_fn(i, q, k, v, allowed_BTS):
    return qwen3.dense_attention(q, k, v, allowed_BTS & same_BTS)

  logits_BTV = sj.forward(params, batch["tokens"], cfg, positions_BT=batch["positions"],
                          mask_BT=seg_BT > 0, attention_fn=attention_fn)
  targets_BT = jnp.roll(batch["tokens"], -1, axis=1)
  logp_BT = sj.token_logprobs(logits_BTV, targets_BT)
  w_BT = batch["weights"]
  loss = -jnp.sum(logp_BT * w_BT) / jnp.maximum(jnp.sum(w_BT), 1.0)
  right_BT = (jnp.argmax(logits_BTV, axis=-1) == targets_BT).astype(jnp.float32)
  lk_BT = batch["lookups"]
  metrics = {"loss": loss,
             "token_acc": jnp.sum(right_BT * w_BT) / jnp.maximum(jnp.sum(w_BT), 1.0),
             "lookup_acc": jnp.sum(right_BT * lk_BT) / jnp.maximum(jnp.sum(lk_BT), 1.0),
             "lookup_nll": -jnp.sum(logp_BT * lk_BT) / jnp.maximum(jnp.sum(lk_BT), 1.0)}
  return loss, metrics


def make_optimizer(args):
  decay_start = int(args.steps * (1 - args.decay_frac))
  schedule = optax.join_schedules([
      optax.linear_schedule(0.0, args.lr, args.warmup),
      optax.constant_schedule(args.lr),
      optax.linear_schedule(args.lr, args.lr * 0.1, max(args.steps - decay_start, 1))],
      [args.warmup, decay_start])
  return optax.chain(optax.clip_by_global_norm(1.0),
                     optax.adamw(schedule, b1=0.9, b2=0.98, weight_decay=0.01)), schedule


def save_checkpoint(workdir, params, opt_state, state):
  """Atomic: params + optimizer state to ckpt.npz, step / level / curves to state.json."""
  leaves = jax.tree_util.tree_leaves((params, opt_state))
  tmp = os.path.join(workdir, "ckpt.tmp.npz")
  np.savez(tmp, *[np.asarray(x) for x in leaves])
  os.replace(tmp, os.path.join(workdir, "ckpt.npz"))
  with open(os.path.join(workdir, "state.tmp.json"), "w") as f:
    json.dump(state, f)
  os.replace(os.path.join(workdir, "state.tmp.json"), os.path.join(workdir, "state.json"))


def load_checkpoint(workdir, params, opt_state):
  with np.load(os.path.join(workdir, "ckpt.npz")) as data:
    leaves = [jnp.asarray(data[f"arr_{i}"]) for i in range(len(data.files))]
  treedef = jax.tree_util.tree_structure((params, opt_state))
  params, opt_state = jax.tree_util.tree_unflatten(treedef, leaves)
  with open(os.path.join(workdir, "state.json")) as f:
    return params, opt_state, json.load(f)


def export(directory, cfg, params):
  """A Hugging Face model dir that sj.load_hf and transformers load."""
  os.makedirs(directory, exist_ok=True)
  eos = synthetic.SPECIAL_TOKENS.index(synthetic.IM_END)
  pad = synthetic.SPECIAL_TOKENS.index(synthetic.EOT)
  sj.save_hf(directory, cfg, params, generation_config={
      "eos_token_id": [eos], "pad_token_id": pad, "do_sample": True, "temperature": 1.0,
      "max_new_tokens": EVAL_TASK.max_response_len})
  synthetic.save_tokenizer(directory)


def main():
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--workdir", default="runs/pretrain_tiny")
  p.add_argument("--export", default="", help="copy the final HF dir here (e.g. assets/...)")
  p.add_argument("--steps", type=int, default=12000)
  p.add_argument("--promote_acc", type=float, default=0.85,
                 help="lookup accuracy on the current level that moves the run up a level")
  p.add_argument("--promote_window", type=int, default=100,
                 help="current-level steps the promotion accuracy is averaged over")
  p.add_argument("--batch_scale", type=int, default=1, help="multiplies every level's rows")
  p.add_argument("--lr", type=float, default=2e-3)
  p.add_argument("--warmup", type=int, default=100)
  p.add_argument("--decay_frac", type=float, default=0.0, help="final share of steps decaying lr")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--log_every", type=int, default=50)
  p.add_argument("--ckpt_minutes", type=float, default=4.0)
  p.add_argument("--snapshot_every", type=int, default=0,
                 help="also export <workdir>/snapshots/step_N every N steps (0 = off), to pick the "
                      "checkpoint whose skill leaves RL room")
  args = p.parse_args()
  os.makedirs(args.workdir, exist_ok=True)
  cfg = model_config()
  params = sj.init_params(cfg, jax.random.PRNGKey(args.seed))
  optimizer, schedule = make_optimizer(args)
  opt_state = optimizer.init(params)
  # level_acc: lookup accuracy of the last --promote_window current-level steps, checkpointed so a
  # resumed run promotes at the same step.
  state = {"step": 0, "elapsed_s": 0.0, "level": 0, "level_acc": [], "promotions": [],
           "history": []}
  if os.path.exists(os.path.join(args.workdir, "ckpt.npz")):
    params, opt_state, state = load_checkpoint(args.workdir, params, opt_state)
    print(f"resumed at step {state['step']}, level {state['level']} "
          f"({state['elapsed_s'] / 60:.1f} min trained)", flush=True)
  print(f"params {cost_model.param_count(cfg):,}  cfg {cfg}", flush=True)

  @jax.jit
  def train_step(params, opt_state, batch):
    (_, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, batch, cfg)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    metrics["grad_norm"] = optax.global_norm(grads)
    return optax.apply_updates(params, updates), opt_state, metrics

  writer = SummaryWriter(os.path.join(args.workdir, "tb"))
  t_last, t_ckpt, window, pending = time.time(), time.time(), [], []
  while state["step"] < args.steps:
    step, level = state["step"], state["level"]
    trained = step_level(step, level)
    params, opt_state, metrics = train_step(
        params, opt_state, pack_batch(args.seed, step, trained, args.batch_scale))
    state["step"] = step = step + 1
    window.append(metrics)
    if trained == level:
      pending.append(metrics["lookup_acc"])   # read back at the log step, not every step
    if step % args.log_every == 0 or step == args.steps:
      now = time.time()
      state["elapsed_s"] += now - t_last
      mean = {k: float(np.mean([float(m[k]) for m in window])) for k in window[0]}
      state["level_acc"] = (state["level_acc"] + [float(x) for x in pending])[-args.promote_window:]
      mean["level_lookup_acc"] = float(np.mean(state["level_acc"]))
      window, pending, t_last = [], [], now
      for k, v in mean.items():
        writer.add_scalar(f"pretrain/{k}", v, step)
      writer.add_scalar("pretrain/level", level, step)
      writer.add_scalar("pretrain/lr", float(schedule(step)), step)
      state["history"].append({"step": step, "minutes": round(state["elapsed_s"] / 60, 2),
                               "level": level, **{k: round(v, 4) for k, v in mean.items()}})
      print(f"step {step:6d}  {state['elapsed_s'] / 60:6.1f} min  level {level} "
            f"(hops {LEVELS[level][0]}-{LEVELS[level][1]})  loss {mean['loss']:.4f}  "
            f"lookup_acc {mean['lookup_acc']:.3f}  level_lookup_acc "
            f"{mean['level_lookup_acc']:.3f}  gnorm {mean['grad_norm']:.2f}", flush=True)
      if (level + 1 < len(LEVELS) and len(state["level_acc"]) == args.promote_window
          and mean["level_lookup_acc"] >= args.promote_acc):
        state["level"] = level + 1
        state["promotions"].append({"step": step, "level": level + 1,
                                    "minutes": round(state["elapsed_s"] / 60, 2)})
        state["level_acc"] = []
        print(f"-> level {level + 1} (hops {LEVELS[level + 1][0]}-{LEVELS[level + 1][1]})",
              flush=True)
      if args.snapshot_every and step % args.snapshot_every == 0:
        export(os.path.join(args.workdir, "snapshots", f"step_{step}"), cfg, params)
      if now - t_ckpt > args.ckpt_minutes * 60 or step == args.steps:
        save_checkpoint(args.workdir, params, opt_state, state)
        export(os.path.join(args.workdir, "hf"), cfg, params)
        t_ckpt = now
  writer.close()
  if args.export:
    export(args.export, cfg, params)
    history = state["history"]
    with open(os.path.join(args.export, "pretrain_log.json"), "w") as f:
      json.dump({"args": vars(args), "train_minutes": round(state["elapsed_s"] / 60, 1),
                 "promotions": state["promotions"],
                 "history": history[::max(len(history) // 100, 1)] + history[-1:]}, f, indent=1)
    print(f"exported to {args.export}", flush=True)


if __name__ == "__main__":
  main()
