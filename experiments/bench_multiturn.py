"""A multi-turn workload whose observations dominate the context, rolled out dense, lossy sparse and
in exact mode, and with slow tools: model tokens/s, KV read per model token, and whether rows that
wait on a tool hold up the others.

  python experiments/bench_multiturn.py --config=configs/bench_multiturn.py \\
      [--config.out=docs/results/multi_turn_workload.json]

The workload is the multi-turn default's (configs/multi_turn.py: env:pointer_chase with its tiny
model) with long observations: each lookup answers with the hop's line among `decoys` other
entries of the table, so a row's context is mostly tool output. Every setting rolls out the same
problems with the same key through `engine.run` (continuous batching, a row pauses on its tool
call, its observation prefilled into its own pages), timed whole, median of `runs` interleaved calls
after a warm-up call each:

  dense, dense again    dense decoding (again: the machine's spread)
  sparse                lossy block-sparse decoding under the config's table
  speculateK            exact mode: K sparse drafts, one dense verification a round
  ... slow tools        the same with every lookup of the odd rows taking `slow_tool_s` longer

model tok/s = the model's own tokens (observations not counted) over the whole call; decode alone
= those tokens over the decode chunks' seconds (EngineStats.decode_seconds; observations are
prefilled outside them). KV read per model token, in (page, layer) reads: dense and lossy sparse
from each model token's cached length (every page of it; sparse layers at most the table's budget
at that length), exact mode as its rounds counted them (drafts and verification,
EngineStats.kv_pages_read). With slow tools, a row waiting on its call must not stall the others:
"stalled bound" is what the call would take if the batch stopped for each slow call in turn (the
fast call plus the slowest row's calls x slow_tool_s); a call near the fast one shows the other
rows decoded on.
"""

import dataclasses
import os
import time

from absl import app, flags
import jax
from ml_collections import config_flags
import numpy as np

from experiments.timing import interleaved_seconds
from sparrow_jax import records
from sparrow_jax.rl import build
from sparrow_jax.rl.rollouts import _prompts
from sparrow_jax.rollout import engine, sampler
from sparrow_jax.sparsity.schedule import KVSchedule

_CONFIG = config_flags.DEFINE_config_file("config", None, "configs/bench_multiturn.py")
flags.mark_flags_as_required(["config"])


def slowed(fn, seconds: float):
  """The tool `fn` answering `seconds` later (a slow sandbox, a remote search)."""

  def slow(**arguments):
    time.sleep(seconds)
    return fn(**arguments)

  return slow


def model_token_lengths(rollout, prompt_len) -> np.ndarray:
  """Cached tokens at each model token of every row (the prompt and every earlier completion token,
  observations included): the lengths its decode step read."""
  B, M = np.shape(rollout.tokens)
  written = np.arange(M)[None] < np.asarray(rollout.lengths)[:, None]
  model = written & ~np.asarray(rollout.observed)
  cached = np.asarray(prompt_len)[:, None] + np.arange(M)[None] + 1
  return cached[model]


def kv_reads(cfg, cached, pages_by_len, sparse, page_size) -> tuple:
  """(dense, sparse) (page, layer) reads a model token, at the cached lengths `cached`."""
  pages = -(-cached // page_size)
  dense = pages * cfg.num_hidden_layers
  if sparse is None:
    return float(dense.mean()), None
  budget = np.minimum(pages_by_len[np.minimum(cached, len(pages_by_len) - 1)], pages)
  d = sparse.dense_layers
  return float(dense.mean()), float((pages * d + budget * (cfg.num_hidden_layers - d)).mean())


def bench(config) -> dict:
  c = config.run
  task = build.make_task(c)
  cfg, params, tokenizer = build.load_model(c, task)
  g = c.rollout.group_size
  problems = task.sample(c.rollout.prompts_per_step, 0)
  prompt, prompt_len = _prompts(problems, tokenizer, g, c.rollout.max_prompt_len)
  requests = engine.Requests(prompt, prompt_len, c.rollout.max_new_tokens, g)
  sparse = build.sparse_config(c)
  schedule = KVSchedule.parse(c.rollout.schedule, c.rollout.page_size)
  base = build.engine_config(c, cfg, len(prompt_len))
  sampling = build.sampling(c, tokenizer)
  pages_by_len = sampler.budget_table(
    schedule, c.rollout.max_prompt_len + c.rollout.max_new_tokens + c.rollout.page_size, sparse
  )
  got = {}

  def setting(name, lossy=False, k=0, slow=False):
    def call():
      turns = task.turns({r: problems[r // g] for r in range(len(prompt_len))}, tokenizer)
      if slow:
        for row, env in turns.envs.items():
          if row % 2:
            env.tools = {n: slowed(fn, config.slow_tool_s) for n, fn in env.tools.items()}
      start = time.perf_counter()
      out, stats = engine.run(
        params,
        cfg,
        requests,
        jax.random.PRNGKey(config.seed),
        engine=dataclasses.replace(base, speculate=k),
        sampling=sampling,
        sparse=sparse if (lossy or k) else None,
        schedule=schedule if (lossy or k) else None,
        turns=turns,
      )
      seconds = time.perf_counter() - start
      slow_calls = max(turns.counts[r]["tool_calls"] for r in turns.envs if r % 2)
      got.setdefault(name, []).append(
        (
          out,
          stats,
          turns.metrics(out.observed, out.lengths, list(turns.envs)),
          seconds,
          slow_calls,
        )
      )

    return name, lossy, k, call

  settings = [setting("dense"), setting("dense again"), setting("sparse", lossy=True)]
  settings += [setting(f"speculate{k}", k=k) for k in config.drafts]
  settings += [setting("dense, slow tools", slow=True)]
  settings += [setting("sparse, slow tools", lossy=True, slow=True)]
  interleaved_seconds([s[3] for s in settings], config.runs)
  rows = []
  for name, lossy, k, _ in settings:
    runs = got[name][-config.runs :]
    wall = float(np.median([r[3] for r in runs]))
    decode_s = float(np.median([r[1].decode_seconds for r in runs]))
    out, stats, metrics = runs[-1][:3]
    cached = model_token_lengths(out, prompt_len)
    dense_reads, sparse_reads = kv_reads(
      cfg, cached, pages_by_len, sparse if lossy else None, c.rollout.page_size
    )
    reads = dense_reads
    if lossy:
      reads = sparse_reads
    elif k:
      reads = stats.kv_pages_read / len(cached)
    rows.append(
      dict(
        setting=name,
        seconds=wall,
        model_tokens=int(len(cached)),
        observation_share=metrics["env/observation_share"],
        tool_calls=metrics["env/tool_calls"],
        tool_seconds=metrics["env/tool_seconds"],
        mean_cached=float(cached.mean()),
        tokens_per_s=len(cached) / wall,
        decode_tokens_per_s=len(cached) / decode_s,
        kv_reads_per_token=reads,
        kv_read_vs_dense=reads / dense_reads,
        draft_acceptance=stats.draft_acceptance if stats.judged else None,
      )
    )
  dense = rows[0]
  for row in rows:
    row["vs_dense"] = row["tokens_per_s"] / dense["tokens_per_s"]
    row["decode_vs_dense"] = row["decode_tokens_per_s"] / dense["decode_tokens_per_s"]
  for row in rows:
    if "slow tools" in row["setting"]:
      fast = next(r for r in rows if r["setting"] == row["setting"].split(",")[0])
      slow_calls = max(run[4] for run in got[row["setting"]][-config.runs :])
      row["stalled_bound_s"] = fast["seconds"] + slow_calls * config.slow_tool_s
  print(
    f"multi-turn workload: {c.task.name} ({c.env.to_dict()}), {len(prompt_len)} rows, tiny model "
    f"{c.model.hf_dir}; median of {config.runs} interleaved calls; KV reads in (page, layer)s"
  )
  for r in rows:
    extra = f"  stalled bound {r['stalled_bound_s']:.1f} s" if "stalled_bound_s" in r else ""
    acc = f"  acceptance {r['draft_acceptance']:.3f}" if r["draft_acceptance"] is not None else ""
    print(
      f"  {r['setting']:20s} {r['seconds']:6.1f} s {r['tokens_per_s']:7.1f} model tok/s "
      f"({r['vs_dense']:.2f}x) decode alone {r['decode_tokens_per_s']:7.1f} "
      f"({r['decode_vs_dense']:.2f}x) KV {r['kv_reads_per_token']:7.1f}/token "
      f"({r['kv_read_vs_dense']:.2f}x dense) obs share {r['observation_share']:.2f}, "
      f"{r['tool_calls']} calls{acc}{extra}"
    )
  return dict(rows=rows, rows_count=len(prompt_len))


def main(argv):
  del argv
  config = _CONFIG.value
  figures = bench(config)
  if config.out:
    records.write_record(
      os.path.join(records.ROOT, config.out), dict(config=config.to_dict(), **figures)
    )
    print(f"wrote {config.out}")


if __name__ == "__main__":
  app.run(main)
