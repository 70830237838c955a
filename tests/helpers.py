"""Shared test helpers: tiny configs and a transformers twin of our params."""

import importlib.util
import os
import re
import socket
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

import sparrow_jax as sj
from sparrow_jax import dashboard
from sparrow_jax.logging import tensorboard_scalars

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tiny_config(**overrides):
  base = dict(
    vocab_size=97,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
  )
  base.update(overrides)
  return sj.Qwen3Config(**base)


def hf_model(cfg, params):
  """transformers' Qwen3ForCausalLM (torch, float32) loaded from our save_hf output."""
  import torch
  import transformers

  path = tempfile.mkdtemp()
  sj.save_hf(path, cfg, jax.tree_util.tree_map(lambda x: np.asarray(x, np.float32), params))
  return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_logits(model, tokens_BT, mask_BT=None, positions_BT=None):
  import torch

  kwargs = {}
  if mask_BT is not None:
    kwargs["attention_mask"] = torch.tensor(np.asarray(mask_BT, np.int64))
  if positions_BT is not None:
    kwargs["position_ids"] = torch.tensor(np.asarray(positions_BT, np.int64))
  with torch.no_grad():
    return model(torch.tensor(np.asarray(tokens_BT, np.int64)), **kwargs).logits.numpy()


def write_tiny_hf_dir(directory, num_hidden_layers=3, corpus=()):
  """A random tiny Qwen3 with a small byte-level BPE tokenizer (Qwen special tokens, EOS
  <|im_end|>) as a Hugging Face dir: what load_hf + load_tokenizer read. Nothing downloaded."""
  from sparrow_jax.data.tokenizer import save_tokenizer, train_bpe

  text = [
    "user assistant system",
    "Please reason step by step, and put your final answer within \\boxed{}.",
    "What is 12 + 7 - 3 * 4? 0 1 2 3 4 5 6 7 8 9",
  ] + list(corpus)
  tok = train_bpe(text, vocab_size=400, added=["<think>", "</think>"])
  save_tokenizer(tok, str(directory))
  cfg = tiny_config(
    vocab_size=tok.get_vocab_size(with_added_tokens=True),
    num_hidden_layers=num_hidden_layers,
    max_position_embeddings=1024,
  )
  sj.save_hf(
    str(directory),
    cfg,
    sj.init_params(cfg, jax.random.PRNGKey(0), std=0.2),
    generation_config={"eos_token_id": tok.token_to_id("<|im_end|>")},
  )
  return cfg


# The default config cut down to seconds a step (random tiny preset, short chains and rollouts).
SMALL = [
  "--config.model.hf_dir=",
  "--config.model.preset=tiny",
  "--config.rollout.schedule=fixed:4",
  "--config.rollout.page_size=8",
  "--config.rollout.dense_layers=1",
  "--config.task.min_hops=4",
  "--config.task.max_hops=8",
  "--config.rollout.max_prompt_len=64",
  "--config.rollout.max_new_tokens=40",
  "--config.stats.bin_size=16",
  "--config.rollout.group_size=4",
  "--config.total_steps=4",
  "--config.ckpt_every=2",
  "--config.rl.num_minibatches=2",
  "--config.rollout.speculate=0",
]  # 2 updates a step compile in half the time of 4; lossy rollouts (the path these runs check)


# XLA flags of every test process: the CPU backend's generated code at LLVM -O0. The suite's time
# is mostly compilation, which this makes cheaper; what the tests compare runs under one setting.
TEST_XLA_FLAGS = "--xla_backend_optimization_level=0"


def free_port() -> int:
  """A port nothing listens on now: a multi-process test's local coordinator's."""
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def run_two_processes(script: str, tmp_path, timeout: int = 600) -> list:
  """`script` (run as python -c) on 2 processes of 2 fake CPU devices each, its argv: the path
  its process writes its .npz to, the local coordinator's port, its process id. Fails with a
  process's output tail when one fails; returns the parts, in process order of their `lo`."""
  import numpy as np

  port, outs = free_port(), [tmp_path / f"process{i}.npz" for i in range(2)]
  procs = [
    subprocess.Popen(
      [sys.executable, "-c", script, str(outs[i]), str(port), str(i)],
      env=subprocess_env(2),
      cwd=ROOT,
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
    )
    for i in range(2)
  ]
  for p in procs:
    out = p.communicate(timeout=timeout)[0]
    assert p.returncode == 0, out[-3000:]
  return sorted((np.load(o) for o in outs), key=lambda part: int(part["lo"]))


def subprocess_env(devices: int = 1) -> dict:
  """A test's JAX subprocess: the CPU with `devices` fake devices, the repo on sys.path, and the
  tests' XLA flags (so it shares the session's compilation cache keys)."""
  return dict(
    os.environ,
    PYTHONPATH=ROOT,
    JAX_PLATFORMS="cpu",
    XLA_FLAGS=f"{TEST_XLA_FLAGS} --xla_force_host_platform_device_count={devices}",
  )


def launch_small(workdir, *overrides, devices=1):
  """The SMALL training run in a subprocess (`devices` fake CPU devices), stdout+stderr piped."""
  cmd = [
    sys.executable,
    "-m",
    "sparrow_jax.train",
    "--config=configs/default.py",
    f"--config.workdir={workdir}",
    *SMALL,
    *overrides,
  ]
  return subprocess.Popen(
    cmd,
    cwd=ROOT,
    stdout=subprocess.PIPE,
    stderr=subprocess.STDOUT,
    text=True,
    env=subprocess_env(devices),
  )


def rows_by_step(workdir):
  """Last logged metrics row of each step, timings dropped."""
  import json

  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    rows = [json.loads(line) for line in f]
  return {r["step"]: {k: v for k, v in r.items() if not k.startswith("perf/")} for r in rows}


# Priced for one device of the run's own engine (its slots and pool per device): differs by mesh.
PER_DEVICE_METRICS = ("kv/predicted_speedup",)


def assert_same_metrics(got, want, steps, atol, skip=()):
  import numpy as np

  for step in steps:
    assert got[step].keys() == want[step].keys()
    for name, value in want[step].items():
      if name in skip:
        continue
      value = np.asarray(value, dtype=float)  # per-bin lists hold None for empty bins -> nan
      np.testing.assert_allclose(
        np.asarray(got[step][name], dtype=float),
        value,
        rtol=1e-5,
        atol=atol,
        err_msg=f"step {step} {name}",
      )


def assert_dashboard_has_data(c, rows):
  """Every tag the dashboard of run `c` names (`dashboard.layout`) has a point among the TensorBoard
  scalars of the run's metrics `rows` (as trainer.train returns them): what catches a misspelled
  or renamed tag."""
  tags = set().union(*(tensorboard_scalars(row) for row in rows))
  regexes = [
    regex
    for charts in dashboard.layout(c).values()
    for kind, named in charts.values()
    for regex in (named if kind == "Multiline" else [re.escape(tag) + "$" for tag in named])
  ]
  missing = [regex for regex in regexes if not any(re.match(regex, tag) for tag in tags)]
  assert not missing, f"dashboard tags the run does not log: {missing}"


def rescored_logprobs(params, cfg, prompt, prompt_len, out, **forward_kwargs):
  """The teacher-forced log-prob of each completion token of a Rollout (dense, or sparse with
  forward_kwargs sparse/schedule/prompt_len_B) and the mask of real completion tokens."""
  from sparrow_jax.model import qwen3
  from sparrow_jax.rollout import sampler

  prompt_len = jnp.asarray(prompt_len)
  seq_BS, _ = sampler.full_sequences(prompt, prompt_len, out)
  logits = sj.forward(params, seq_BS, cfg, mask_BT=seq_BS != -1, **forward_kwargs)
  logp_BS = jnp.pad(qwen3.token_logprobs(logits[:, :-1], seq_BS[:, 1:]), ((0, 0), (1, 0)))
  # completion token j of row b sits at position prompt_len[b] + j
  idx = jnp.minimum(
    prompt_len[:, None] + jnp.arange(out.tokens.shape[1])[None], seq_BS.shape[1] - 1
  )
  valid = jnp.arange(out.tokens.shape[1])[None] < out.lengths[:, None]
  return jnp.take_along_axis(logp_BS, idx, 1), valid


def load_file(path: str):
  """The module of a script that is not a package module (experiments/*.py run as scripts,
  docs/make_results_pages.py), from its path under ROOT."""
  name = os.path.splitext(os.path.basename(path))[0]
  spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, path))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def play_episode(env, actions, pool, timeout_s=60.0):
  """Steps `actions` through env, running each call in pool; returns the steps (observed ones
  replacing their calls)."""
  steps = []
  for action in actions:
    step = env.step(action)
    if step.call:
      pool.submit("row", env.tools[step.call.name], **step.call.arguments)
      (result,) = pool.wait(timeout_s=timeout_s)
      step = env.observe(result)
    steps.append(step)
    if step.done:
      break
  return steps
