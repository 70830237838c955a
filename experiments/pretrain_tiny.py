"""Pretrains the embedded default model: a tiny Qwen3 on the pointer-chasing task, on a CPU.

  nice -n 10 python experiments/pretrain_tiny.py --workdir runs/pretrain_tiny --steps 3000

Teacher-forced next-token loss on the response tokens only (the prompt's table is random, so there is
nothing to learn from predicting it). Problems of every length (1..128 hops) are mixed from the first
step and packed into fixed rows with a per-problem attention mask and positions restarting at 0, so
one compiled shape serves all lengths and short problems (where the lookup skill appears first) share
each update with long ones. Small batches: many cheap updates beat few big ones for this model.

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
from sparrow_jax.model import qwen3

# Each step draws one length bucket (rows x row_len tokens, with the hop counts that fit it): short
# rows keep the T^2 attention cheap where problems are short. Tiny tables (1..6 hops) dominate the
# first `--early_steps`: with few entries a half-formed lookup circuit already lowers the loss, which
# shortens the plateau before the lookup (induction) skill appears; every length (up to 128 hops, the
# evaluation length) stays in the mix from the first steps, then the cycle balances the buckets.
BUCKETS = {  # name: (row_len, rows, task)
    "tiny": (128, 8, synthetic.PointerChase(min_hops=1, max_hops=6)),
    "short": (256, 8, synthetic.PointerChase(min_hops=7, max_hops=32)),
    "mid": (512, 4, synthetic.PointerChase(min_hops=33, max_hops=72)),
    "long": (896, 2, synthetic.PointerChase(min_hops=73, max_hops=128)),
}
EARLY_CYCLE = ("tiny", "tiny", "short", "tiny", "tiny", "mid", "tiny", "tiny", "long")
LATE_CYCLE = ("tiny", "short", "mid", "long", "short", "mid", "long")
EVAL_TASK = synthetic.PointerChase()


def model_config() -> sj.Qwen3Config:
  return sj.Qwen3Config(
      vocab_size=len(synthetic.vocab()), hidden_size=128, intermediate_size=384,
      num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
      rope_theta=1e6, tie_word_embeddings=True, max_position_embeddings=2048)


def bucket(step: int, early_steps: int) -> str:
  cycle = EARLY_CYCLE if step < early_steps else LATE_CYCLE
  return cycle[step % len(cycle)]


def pack_batch(seed: int, step: int, name: str, scale: int = 1):
  """Packs freshly sampled problems into the rows of bucket `name` (rows x `scale`).

  Returns int32 tokens, segment ids (0 = padding), positions, float32 loss weights (1 where the next
  token is a response token of the same problem) and the subset of weights on lookup targets (the
  value of each hop: the far-back retrievals), all [rows, row_len].
  """
  row_len, rows, task = BUCKETS[name]
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


def save_checkpoint(workdir, step, elapsed, params, opt_state, history):
  leaves = jax.tree_util.tree_leaves((params, opt_state))
  tmp = os.path.join(workdir, "ckpt.tmp.npz")
  np.savez(tmp, *[np.asarray(x) for x in leaves])
  os.replace(tmp, os.path.join(workdir, "ckpt.npz"))
  with open(os.path.join(workdir, "state.tmp.json"), "w") as f:
    json.dump({"step": step, "elapsed_s": elapsed, "history": history}, f)
  os.replace(os.path.join(workdir, "state.tmp.json"), os.path.join(workdir, "state.json"))


def load_checkpoint(workdir, params, opt_state):
  with np.load(os.path.join(workdir, "ckpt.npz")) as data:
    leaves = [jnp.asarray(data[f"arr_{i}"]) for i in range(len(data.files))]
  treedef = jax.tree_util.tree_structure((params, opt_state))
  params, opt_state = jax.tree_util.tree_unflatten(treedef, leaves)
  with open(os.path.join(workdir, "state.json")) as f:
    state = json.load(f)
  return params, opt_state, state["step"], state["elapsed_s"], state["history"]


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
  p.add_argument("--steps", type=int, default=3000)
  p.add_argument("--early_steps", type=int, default=1200, help="steps of the tiny-table-heavy mix")
  p.add_argument("--batch_scale", type=int, default=1, help="multiplies every bucket's rows")
  p.add_argument("--lr", type=float, default=2e-3)
  p.add_argument("--warmup", type=int, default=100)
  p.add_argument("--decay_frac", type=float, default=0.2, help="final share of steps decaying lr")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--log_every", type=int, default=20)
  p.add_argument("--ckpt_minutes", type=float, default=4.0)
  args = p.parse_args()
  os.makedirs(args.workdir, exist_ok=True)
  cfg = model_config()
  params = sj.init_params(cfg, jax.random.PRNGKey(args.seed))
  optimizer, schedule = make_optimizer(args)
  opt_state = optimizer.init(params)
  step, elapsed, history = 0, 0.0, []
  if os.path.exists(os.path.join(args.workdir, "ckpt.npz")):
    params, opt_state, step, elapsed, history = load_checkpoint(args.workdir, params, opt_state)
    print(f"resumed at step {step} ({elapsed / 60:.1f} min trained)", flush=True)
  print(f"params {qwen3.param_count(params):,}  cfg {cfg}", flush=True)

  @jax.jit
  def train_step(params, opt_state, batch):
    (_, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, batch, cfg)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    metrics["grad_norm"] = optax.global_norm(grads)
    return optax.apply_updates(params, updates), opt_state, metrics

  writer = SummaryWriter(os.path.join(args.workdir, "tb"))
  t_last, t_ckpt, acc = time.time(), time.time(), []
  while step < args.steps:
    batch = pack_batch(args.seed, step, bucket(step, args.early_steps), args.batch_scale)
    params, opt_state, metrics = train_step(params, opt_state, batch)
    step += 1
    acc.append(metrics)
    if step % args.log_every == 0 or step == args.steps:
      now = time.time()
      elapsed += now - t_last
      mean = {k: float(np.mean([float(m[k]) for m in acc])) for k in acc[0]}
      acc, t_last = [], now
      for k, v in mean.items():
        writer.add_scalar(f"pretrain/{k}", v, step)
      writer.add_scalar("pretrain/lr", float(schedule(step)), step)
      history.append({"step": step, "minutes": round(elapsed / 60, 2),
                      **{k: round(v, 4) for k, v in mean.items()}})
      print(f"step {step:6d}  {elapsed / 60:6.1f} min  loss {mean['loss']:.4f}  "
            f"tok_acc {mean['token_acc']:.3f}  lookup_acc {mean['lookup_acc']:.3f}  "
            f"lookup_nll {mean['lookup_nll']:.3f}  gnorm {mean['grad_norm']:.2f}", flush=True)
      if now - t_ckpt > args.ckpt_minutes * 60 or step == args.steps:
        save_checkpoint(args.workdir, step, elapsed, params, opt_state, history)
        export(os.path.join(args.workdir, "hf"), cfg, params)
        t_ckpt = now
  writer.close()
  if args.export:
    export(args.export, cfg, params)
    with open(os.path.join(args.export, "pretrain_log.json"), "w") as f:
      json.dump({"args": vars(args), "train_minutes": round(elapsed / 60, 1),
                 "history": history[::max(len(history) // 100, 1)] + history[-1:]}, f, indent=1)
    print(f"exported to {args.export}", flush=True)


if __name__ == "__main__":
  main()
