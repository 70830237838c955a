"""A tiny Qwen3 trained in seconds on key-value recall, for tests that need attention structure.

Random weights have no systematic sparse-attention error for an adapter to learn; this model does.
A prompt is BOS, then NUM_KEYS pair tokens (key a, value v_a) shuffled among 8..24 FILL tokens, then
SEP; the completion recalls every pair in key order, `key_0 val_0 key_1 val_1 ... EOS`. Each value
is copied from its pair token far back in the prompt (one content-matched attention hop), which a
small page budget sometimes drops. The q/k RMSNorm weights stay frozen at 1 while training, which
bounds attention logits by sqrt(head_dim) = 2: attention stays soft, as in real LMs where many pages
carry some mass, so sparse attention perturbs the output smoothly instead of only by missed pages.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax

import sparrow_jax as sj

PAD, BOS, SEP, EOS, FILL = range(5)
NUM_KEYS, NUM_VALUES = 8, 8
MIN_FILL, MAX_FILL = 8, 24
KEY0 = 5
VALUE0 = KEY0 + NUM_KEYS
PAIR0 = VALUE0 + NUM_VALUES  # (key a, value v) is token PAIR0 + a * NUM_VALUES + v
PROMPT_LEN = 1 + MAX_FILL + NUM_KEYS + 1  # widest prompt (right-padded to this)
COMPLETION_LEN = 2 * NUM_KEYS + 1
SEQ_LEN = PROMPT_LEN + COMPLETION_LEN

CONFIG = sj.Qwen3Config(
  vocab_size=PAIR0 + NUM_KEYS * NUM_VALUES,
  hidden_size=64,
  intermediate_size=128,
  num_hidden_layers=2,
  num_attention_heads=4,
  num_key_value_heads=2,
  head_dim=4,
  rope_theta=1e4,
  max_position_embeddings=128,
)


def sample(rng: np.random.RandomState, batch: int):
  """Right-padded rows of prompt + reference completion: tokens [B, SEQ_LEN] int32, prompt_len [B],
  length [B] (prompt + completion)."""
  tokens = np.full((batch, SEQ_LEN), PAD, np.int32)
  prompt_len, length = np.zeros(batch, np.int32), np.zeros(batch, np.int32)
  for b in range(batch):
    values = rng.randint(0, NUM_VALUES, NUM_KEYS)
    body = np.array(
      [FILL] * rng.randint(MIN_FILL, MAX_FILL + 1)
      + [PAIR0 + a * NUM_VALUES + v for a, v in enumerate(values)]
    )
    body = body[rng.permutation(len(body))]
    completion = np.stack([KEY0 + np.arange(NUM_KEYS), VALUE0 + values], 1).reshape(-1)
    row = np.concatenate([[BOS], body, [SEP], completion, [EOS]])
    tokens[b, : len(row)] = row
    prompt_len[b], length[b] = len(body) + 2, len(row)
  return tokens, prompt_len, length


def completion_mask(prompt_len, length):
  """[B, SEQ_LEN - 1] mask of the logits positions that predict a completion token."""
  s = jnp.arange(1, SEQ_LEN)[None]
  return (s >= prompt_len[:, None]) & (s < length[:, None])


def _loss(params, tokens, prompt_len, length):
  logits = sj.forward(params, tokens, CONFIG, mask_BT=jnp.arange(SEQ_LEN)[None] < length[:, None])
  logp = sj.token_logprobs(logits[:, :-1], tokens[:, 1:])
  mask = completion_mask(prompt_len, length)
  return -jnp.sum(logp * mask) / jnp.sum(mask)


def pretrain(seed: int = 0, steps: int = 500, batch: int = 16, lr: float = 3e-3):
  """Dense next-token training on the completions (the prompts are random: nothing to learn there).
  Returns (params, final loss)."""
  optimizer = optax.adam(lr)

  @jax.jit
  def step(params, opt_state, tokens, prompt_len, length):
    loss, grads = jax.value_and_grad(_loss)(params, tokens, prompt_len, length)
    zero = jnp.zeros_like
    g = grads["layers"]
    grads["layers"] = dict(g, q_norm=zero(g["q_norm"]), k_norm=zero(g["k_norm"]))  # frozen at 1
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  params = sj.init_params(CONFIG, jax.random.PRNGKey(seed), std=0.05)
  opt_state, rng = optimizer.init(params), np.random.RandomState(seed)
  for _ in range(steps):
    params, opt_state, loss = step(params, opt_state, *map(jnp.asarray, sample(rng, batch)))
  return params, float(loss)
