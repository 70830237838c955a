"""Dense decode tokens/s of one tiny Qwen3 in our sampler and in google-tunix's, side by side.

  python experiments/bench_tunix.py --config=configs/bench_tunix.py \\
      --config.tunix.python=VENV/bin/python   # needs google-tunix in VENV
  python experiments/bench_tunix.py --config=configs/bench_tunix.py \\
      --config.tunix.python=VENV/bin/python --config.out=docs/results/decode_rollout_tunix.json

Dense decode tokens/s of a tiny Qwen3 (TINY below) in our sampler (sj.generate) and in
google-tunix's (tunix.generate.sampler.Sampler over tunix.models.qwen3), our random weights copied
into tunix's model, greedy, side by side in one process; decode tok/s comes from two generation
lengths so that prefill and per-call overheads cancel. Beside them, the roofline: the measured time
to read every weight once (`weight_read_ms`), the floor of a small-batch decode step. The greedy
tokens of both are compared as a check that the two run the same model. tunix is optional: it is
not a project dependency and lives in a separate venv (google-tunix 0.1.7 installs from PyPI with
jax 0.10.2 and runs offline on CPU), named by `tunix.python`; the script then reruns itself under
that interpreter. Without it the script prints how to make that venv.

With `out` set and tunix run, the printed figures and the config are written there as one results
record (sparrow_jax/records.py), from which docs/make_results_pages.py makes
docs/results/decode_rollout.md.
"""

import functools
import importlib.metadata
import json
import os
import subprocess
import sys
import tempfile

from absl import app, flags
import jax
import jax.numpy as jnp
from ml_collections import config_flags
import numpy as np

from experiments.timing import median_seconds
import sparrow_jax as sj
from sparrow_jax import records
from sparrow_jax.attention import reference
from sparrow_jax.rollout import programs

TINY = dict(
  vocab_size=8192,
  hidden_size=512,
  intermediate_size=1536,
  num_hidden_layers=4,
  num_attention_heads=8,
  num_key_value_heads=4,
  head_dim=64,
  tie_word_embeddings=True,
)


class _IdTokenizer:
  """The interface tunix's sampler takes strings through: here a prompt is its token ids written
  out, so both samplers see the same ids. No BOS; `eos` is outside the vocabulary (never sampled),
  so every row decodes the full length in both."""

  def __init__(self, pad: int, eos: int):
    self.pad, self.eos = pad, eos

  def encode(self, text, **kwargs):
    return [int(t) for t in text.split()]

  def decode(self, ids, **kwargs):
    return " ".join(str(int(i)) for i in ids)

  def bos_id(self):
    return None

  def eos_id(self):
    return self.eos

  def pad_id(self):
    return self.pad


def _tunix_model(cfg, params, nnx, tunix_qwen3):
  """tunix's Qwen3 (flax nnx) holding our params: same math, its own [D, N, E] weight layout."""
  D, E = cfg.hidden_size, cfg.head_dim
  H, K = cfg.num_attention_heads, cfg.num_key_value_heads
  config = tunix_qwen3.ModelConfig(
    num_layers=cfg.num_hidden_layers,
    vocab_size=cfg.vocab_size,
    embed_dim=D,
    hidden_dim=cfg.intermediate_size,
    num_heads=H,
    head_dim=E,
    num_kv_heads=K,
    rope_theta=int(cfg.rope_theta),
    norm_eps=cfg.rms_norm_eps,
    use_tied_embedding=True,
  )
  model = tunix_qwen3.Qwen3(config, rngs=nnx.Rngs(0))
  model.embedder.input_embedding.value = params["embed"]
  model.final_norm.w.value = params["final_norm"]
  for i, layer in enumerate(model.layers):
    p = {name: w[i] for name, w in params["layers"].items()}
    layer.input_layernorm.w.value = p["attn_norm"]
    layer.post_attention_layernorm.w.value = p["mlp_norm"]
    layer.attn.q_proj.w.value = p["q"].reshape(D, H, E)
    layer.attn.k_proj.w.value = p["k"].reshape(D, K, E)
    layer.attn.v_proj.w.value = p["v"].reshape(D, K, E)
    layer.attn.o_proj.w.value = p["o"].reshape(H, E, D)
    layer.attn.q_norm.w.value = p["q_norm"]
    layer.attn.k_norm.w.value = p["k_norm"]
    layer.mlp.gate_proj.kernel.value = p["gate"]
    layer.mlp.up_proj.kernel.value = p["up"]
    layer.mlp.down_proj.kernel.value = p["down"]
  return model


def weight_read_ms(params, runs):
  """ms to read every parameter once, measured: a jitted loop of 16 passes that each add the pass
  index to every weight and reduce it (the index keeps XLA from hoisting the read out of the
  loop). The floor of a decode step at small batch, which reads every weight once."""
  leaves = jax.tree_util.tree_leaves(params)

  @jax.jit
  def passes(leaves):
    body = lambda i, acc: acc + sum(jnp.sum(x + i.astype(x.dtype)) for x in leaves)
    return jax.lax.fori_loop(0, 16, body, jnp.float32(0.0))

  return median_seconds([lambda: jax.block_until_ready(passes(leaves))], runs)[0] * 1e3 / 16


SAMPLERS = ("sparrow_jax sj.generate", "tunix generate.Sampler")


def _no_attention(q_BKGE, *_):
  return q_BKGE


def _page_gather_only(q_BKGE, k_pages_XZE, v_pages_XZE, page_idx_BKN, *_):
  """Reads the pages the attention would (the same gather) and nothing more."""
  read = lambda pages: jnp.mean(pages.at[page_idx_BKN].get(mode="clip"), axis=(2, 3))[:, :, None]
  return q_BKGE + read(k_pages_XZE) + read(v_pages_XZE)


# Stand-ins for the paged attention inside our decode step (reference.paged_decode_attention, what
# the engine's decode chunk reads the pool through on CPU), which split the step: with no attention
# at all, the rest (weights, cache appends, sampling); with the page gather alone, what reading the
# pages costs before any arithmetic on them.
STEP_PROBES = {"no attention": _no_attention, "page gather alone": _page_gather_only}


def with_attention(run, attention):
  """run() with the engine's decode chunk compiled around `attention` in place of the paged
  attention: a new jit of the chunk's function, traced on its first call with the stand-in in
  place (jit caches a trace per function, so the engine's own chunk keeps the real attention)."""
  raw = programs.decode_chunk.__wrapped__
  chunk = jax.jit(
    functools.wraps(raw)(lambda *a, **k: raw(*a, **k)),
    static_argnames=("cfg", "steps", "sparse", "sampling"),
    donate_argnames=("pool",),
  )

  def probed():
    real_attention, real_chunk = reference.paged_decode_attention, programs.decode_chunk
    reference.paged_decode_attention, programs.decode_chunk = attention, chunk
    try:
      return run()
    finally:
      reference.paged_decode_attention, programs.decode_chunk = real_attention, real_chunk

  return probed


def sampler_figures(batch, gen, seconds, read_ms) -> dict:
  """Each sampler's decode tok/s and ms per decode step from its median call times at the two
  generation lengths (`seconds`: name -> (short, long)); the difference cancels prefill and
  per-call overheads. `per_read` holds a step against the time to read the weights once."""
  short, long = gen
  figures = {}
  for name, (short_s, long_s) in seconds.items():
    tok_s = batch * (long - short) / (long_s - short_s)
    step_ms = 1e3 * batch / tok_s
    figures[name] = dict(
      short_s=short_s, long_s=long_s, tok_s=tok_s, step_ms=step_ms, per_read=step_ms / read_ms
    )
  return figures


def print_tunix(fig) -> None:
  m, (short, long) = fig["model"], fig["gen"]
  ours, theirs = (fig["samplers"][name] for name in SAMPLERS)
  print(
    f"dense decode, tiny Qwen3 ({m['layers']} layers, width {m['hidden_size']}, "
    f"{m['heads']}/{m['kv_heads']} heads, vocab {m['vocab_size']}, float32, random weights "
    f"shared by both), batch {fig['batch']}, prompt {fig['prompt']}, greedy; decode tok/s = "
    f"batch x ({long} - {short}) / (time({long}) - time({short})), medians of {fig['runs']} "
    "calls (prefill and per-call overheads cancel)"
  )
  print(f"{'sampler':>28} {f'{short} tok s':>9} {f'{long} tok s':>9} {'decode tok/s':>13}")
  for name, s in fig["samplers"].items():
    print(f"{name:>28} {s['short_s']:>9.3f} {s['long_s']:>9.3f} {s['tok_s']:>13.1f}")
  print(
    f"    roofline: reading the {fig['weight_bytes'] / 1e6:.1f} MB of weights once takes "
    f"{fig['weight_read_ms']:.2f} ms (measured); a decode step takes {ours['step_ms']:.2f} ms "
    f"here ({ours['per_read']:.2f}x the read), {theirs['step_ms']:.2f} ms in tunix"
  )
  split = fig["step_split"]
  print(
    f"    our step split: {ours['step_ms']:.2f} ms in all, "
    f"{split['no attention']:.2f} ms with no attention, "
    f"{split['page gather alone']:.2f} ms with the page gather alone in its place"
  )
  print(
    f"    ours / tunix: {fig['ours_over_tunix']:.2f}x; same greedy tokens: "
    f"{fig['same_tokens']}/{fig['tokens']} (tunix returned {fig['tokens_per_row']['tunix']} "
    f"tokens per row, ours {fig['tokens_per_row']['ours']})"
  )


def _tunix_version() -> str:
  try:
    return importlib.metadata.version("google-tunix")
  except importlib.metadata.PackageNotFoundError:
    return "unknown"


def _tunix_elsewhere(python):
  """This benchmark rerun under `python` (tunix's venv) with the same config; its figures, or None
  when it skipped. They come back through a results record written to a temporary file."""
  sys.stdout.flush()
  with tempfile.TemporaryDirectory() as tmp:
    out = os.path.join(tmp, "tunix.json")
    subprocess.run(
      [
        python,
        os.path.abspath(__file__),
        *sys.argv[1:],
        "--config.tunix.python=",
        f"--config.out={out}",
      ],
      check=True,
    )
    if not os.path.exists(out):
      return None
    with open(out) as f:
      return json.load(f)["results"]["tunix"]


def bench_tunix(config):
  """Prints our sampler against tunix's and returns the figures, or None when google-tunix is
  not importable (it prints how to make a venv for it)."""
  if config.tunix.python:
    return _tunix_elsewhere(config.tunix.python)
  try:
    from flax import nnx
    from tunix.generate import sampler as tunix_sampler
    from tunix.models.qwen3 import model as tunix_qwen3
  except ImportError as e:
    print(
      f"skipped: google-tunix is not importable in this Python ({sys.executable}): {e}. "
      "It is not a project dependency; make a venv for it (python3 -m venv VENV && "
      "VENV/bin/pip install google-tunix jax==0.10.2 flax safetensors tokenizers "
      "ml_collections && VENV/bin/pip install --no-deps -e .) and set "
      "--config.tunix.python=VENV/bin/python."
    )
    return None
  if len(config.tunix.gen) != 2 or not 0 < config.tunix.gen[0] < config.tunix.gen[1]:
    raise ValueError(f"tunix.gen must be two lengths 0 < short < long, got {config.tunix.gen}")
  B, P = config.batch, config.tunix.prompt
  short, long = config.tunix.gen
  cfg = sj.Qwen3Config(**TINY, max_position_embeddings=P + long)
  params = sj.init_params(cfg, jax.random.PRNGKey(0))
  model = _tunix_model(cfg, params, nnx, tunix_qwen3)
  prompt_BT = np.random.default_rng(0).integers(1, cfg.vocab_size, (B, P)).astype(np.int32)
  prompt_len_B = np.full((B,), P, np.int32)
  texts = [" ".join(map(str, row)) for row in prompt_BT]
  tokenizer = _IdTokenizer(pad=0, eos=cfg.vocab_size)
  # Each sampler's cache holds exactly prompt + generation, as ours does (both read all of it).
  samplers = {
    n: tunix_sampler.Sampler(
      model,
      tokenizer,
      tunix_sampler.CacheConfig(
        cache_size=P + n,
        num_layers=cfg.num_hidden_layers,
        num_kv_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim,
      ),
    )
    for n in (short, long)
  }
  outputs = {}

  def ours(n, name="ours"):
    def run():
      outputs[name, n] = np.asarray(
        sj.generate(
          params,
          cfg,
          prompt_BT,
          prompt_len_B,
          jax.random.PRNGKey(0),
          max_new_tokens=n,
          sampling=sj.Sampling(temperature=0.0),
        ).tokens
      )

    return run

  def theirs(n):
    def run():
      out = samplers[n](
        texts,
        max_generation_steps=n,
        max_prompt_length=P,
        temperature=0.0,
        eos_tokens=[tokenizer.eos],
      )
      outputs["tunix", n] = np.stack([np.asarray(t) for t in out.tokens])

    return run

  probes = [
    with_attention(ours(n, name), attention)
    for name, attention in STEP_PROBES.items()
    for n in (short, long)
  ]
  ours_s, ours_l, tunix_s, tunix_l, *probe_s = median_seconds(
    [ours(short), ours(long), theirs(short), theirs(long), *probes], config.runs
  )
  read_ms = weight_read_ms(params, config.runs)
  seconds = dict(zip(SAMPLERS, [(ours_s, ours_l), (tunix_s, tunix_l)]))
  by_sampler = sampler_figures(B, (short, long), seconds, read_ms)
  probe_seconds = {name: tuple(probe_s[2 * i : 2 * i + 2]) for i, name in enumerate(STEP_PROBES)}
  split = sampler_figures(B, (short, long), probe_seconds, read_ms)
  a, b = outputs["ours", long], outputs["tunix", long]
  same = int(np.sum(a[:, : b.shape[1]] == b)) if a.shape[0] == b.shape[0] else 0
  fig = dict(
    model=dict(
      layers=cfg.num_hidden_layers,
      hidden_size=cfg.hidden_size,
      heads=cfg.num_attention_heads,
      kv_heads=cfg.num_key_value_heads,
      vocab_size=cfg.vocab_size,
    ),
    batch=B,
    prompt=P,
    gen=[short, long],
    runs=config.runs,
    samplers=by_sampler,
    step_split={name: f["step_ms"] for name, f in split.items()},
    weight_bytes=sum(x.nbytes for x in jax.tree_util.tree_leaves(params)),
    weight_read_ms=read_ms,
    ours_over_tunix=by_sampler[SAMPLERS[0]]["tok_s"] / by_sampler[SAMPLERS[1]]["tok_s"],
    same_tokens=same,
    tokens=int(b.size),
    tokens_per_row=dict(ours=int(a.shape[1]), tunix=int(b.shape[1])),
    versions=dict(tunix=_tunix_version(), jax=jax.__version__, python=sys.version.split()[0]),
  )
  print_tunix(fig)
  return fig


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}: settings go in --config.FIELD=VALUE")
  config = flags.FLAGS.config
  tunix = bench_tunix(config)
  if config.out and tunix is not None:
    records.write_record(
      os.path.join(records.ROOT, config.out), dict(config=config.to_dict(), tunix=tunix)
    )
    print(f"    record: {config.out}")


if __name__ == "__main__":
  # Defined here, not at import: tests import scripts beside others that define --config.
  config_flags.DEFINE_config_file("config", "configs/bench_tunix.py", "experiment config")
  app.run(main)
