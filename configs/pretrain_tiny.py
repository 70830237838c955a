"""Pretrains the embedded default model (assets/pointer_chase_tiny): a tiny Qwen3 learns the
pointer-chasing task from scratch on a CPU, 2400 steps (10.5 minutes on this shared 2-core CPU),
bit-reproducible. Continuing to 3000 steps with config.decay_frac = 0.2 solves the task, leaving RL
nothing to improve (assets/pointer_chase_tiny/README.md).

  nice -n 10 python experiments/pretrain_tiny.py --config=configs/pretrain_tiny.py \\
      --config.export_dir=assets/pointer_chase_tiny   # the shipped model
"""

import ml_collections


def get_config():
  c = ml_collections.ConfigDict()
  c.seed = 0  # params init and every step's data (a pure function of (seed,
  #                                    step), so a resumed run sees the same batches)
  c.workdir = (
    "workdir/pretrain_tiny"  # checkpoints, TensorBoard, metrics.jsonl, hf/; reused = resume
  )
  c.export_dir = ""  # copy the final HF dir (+ pretrain_log.json) here ("" = none)
  c.total_steps = 2400  # AdamW steps
  c.learning_rate = 2e-3  # peak learning rate
  c.warmup_steps = 100  # linear warmup from 0
  c.decay_frac = 0.0  # final share of the steps decaying lr linearly to lr / 10
  c.promote_acc = 0.85  # lookup accuracy on the current level that moves up a level
  c.promote_window = 100  # current-level steps the promotion accuracy is averaged over
  c.batch_scale = 1  # multiplies every level's rows
  c.log_every = 50  # steps between progress lines / metrics rows
  c.ckpt_minutes = 4.0  # minutes between checkpoints (and <workdir>/hf refreshes)
  c.keep_checkpoints = 1  # newest checkpoints kept
  c.snapshot_every = 0  # also export <workdir>/snapshots/step_N every N steps (0 =
  #                                    off), to pick the checkpoint whose skill leaves RL room

  # Two layers: the lookup needs two (gather each entry into its `;`, then match and copy), and half
  # the depth is twice the updates per CPU-minute; with rollout.dense_layers = 1 the matching layer
  # is the sparse one, so a small KV budget hits exactly the far-back lookups. The vocabulary is the
  # synthetic task's.
  c.arch = ml_collections.ConfigDict()
  c.arch.hidden_size = 128  # d_model
  c.arch.intermediate_size = 384  # SwiGLU width
  c.arch.num_hidden_layers = 2  # layers
  c.arch.num_attention_heads = 4  # query heads
  c.arch.num_key_value_heads = 2  # KV heads (GQA)
  c.arch.head_dim = 32  # per-head width
  c.arch.rope_theta = 1e6  # RoPE base
  c.arch.tie_word_embeddings = True  # output projection = embedding
  c.arch.max_position_embeddings = 2048  # longest position (a 128-hop problem is ~880 tokens)

  # A length curriculum: level k trains on levels[k] = (min_hops, max_hops, row_len, rows), ~2K
  # tokens a step, rows short where problems are short so the T^2 attention stays cheap. The lookup
  # (layer 0 gathers each entry's key into its `;`, a layer-1 head matches the current key there and
  # copies the value; see assets/pointer_chase_tiny/README.md) forms within a few hundred updates on
  # 1..4-hop tables but not when long tables dominate the batches (a 5100-step run mixing all
  # lengths from step 0 never formed it), so the run moves up a level once the lookup accuracy on
  # the current level reaches promote_acc. Every other step replays a lower level so shorter
  # lengths are not forgotten.
  c.levels = (
    (1, 4, 64, 32),
    (5, 8, 128, 16),
    (9, 16, 256, 8),
    (17, 32, 256, 8),
    (33, 64, 512, 4),
    (65, 128, 896, 2),
  )
  return c
