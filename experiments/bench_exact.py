"""Exact mode (sparse drafts, dense verify) beside dense and lossy sparse decoding, with fixed draft
counts and with the regime switch (`rollout.speculate = "auto"`), tokens/s side by side in one run.

  python experiments/bench_exact.py --config=configs/bench_exact.py \\
      [--config.record=docs/results/speculative_rollout.json]

(1) Long context, random model: the engine's own decode programs over one page pool (the same rows
and pages for every setting), a Qwen3-1.7B-shaped model cut to `shapes.layers` layers with random
weights, rows at a fixed context of random cached keys (bench_decode's cache). A timed call is
one chunk of `steps` tokens (dense, sparse) or of the rounds that draft as many (exact mode); the
calls are interleaved and a cell is the median over `runs` after a warm-up call. dense: every
layer reads every cached page; sparse: the paper's tau table (lossy: rows are the sparse policy's);
speculateK: K sparse drafts and one dense verification pass a round; auto: the regime switch's
plan, priced as the trainer's switch prices it (`hooks.DraftSwitch`: the roofline's shape, the
measured seconds per round of dense decoding and of each speculateK, at the drafts' mean
acceptance measured at this context on the speculateK rows' judged drafts), all measured before
it plans as the trainer's earlier steps measure them, then run as the engine runs it (a chunk
runs the program of the most drafts its rounds take; none: dense decode steps).

(2) A trained model at its own context: the shipped tiny model on its task's prompts (the default
job's prompts, group size and cutoff), whole rollouts through `engine.run` (prefill, decode, refill)
for dense, sparse (its calibrated table), speculateK and auto, interleaved, median over `runs`.
auto's plan comes from the drafts' mean acceptance per position bin measured on the speculateK
rollout (`Rollout.alpha`) and the engine's own seconds per round (`EngineStats.round_timings`)
of the dense and speculateK rollouts, each chunk at the cached length it ran at, priced as in
(1). Exact rows are dense samples and sparse ones are not, so the settings' rows have different
lengths: tokens/s counts each setting's own tokens.

(3) Long prompts of real text (`long_prompts.enabled`, off by default): a real model dir's model on
prompts cut from local files (`sparrow_jax/data/long_prompts.py`: by default this interpreter's
standard library) to each of `long_prompts.lengths` tokens, in its chat template with an
instruction; every setting of (2) runs once per length, and the record names the files each
prompt holds. Without the model dir, or with lengths past its positions, the run is refused in one
line before anything else runs.

Every ratio is measured in this run. `record` writes a results record, from which
docs/make_results_pages.py makes docs/results/speculative_rollout.md.
"""

import dataclasses
import functools
import os
import types

from absl import app, flags
import jax
import jax.numpy as jnp
from ml_collections import config_flags
import numpy as np

from experiments.bench_decode import model_config
from experiments.timing import median_seconds
import sparrow_jax as sj
from sparrow_jax import records
from sparrow_jax.attention import page_pool, paged_cache
from sparrow_jax.data import long_prompts
from sparrow_jax.data.tokenizer import load_tokenizer
from sparrow_jax.mismatch import calibrate, cost_model
from sparrow_jax.model import qwen3
from sparrow_jax.rl import build, hooks
from sparrow_jax.rollout import engine, programs, sampler
from sparrow_jax.sparsity.schedule import KVSchedule

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@functools.partial(jax.jit, static_argnames=("page_score",), donate_argnames=("k", "v", "s"))
def _fill_pool_layer(k, v, s, key, *, page_score):
  """One layer of a pool filled with random keys and values (unit normal, as bench_decode's cache)
  on every page, and their page summaries. Drawn in the summaries' dtype, the pool's own: keys and
  values may be stored as its bits (`paged_cache.stored_dtype`)."""
  key_k, key_v = jax.random.split(key)
  k = jax.random.normal(key_k, k.shape, jnp.float32).astype(s.dtype)
  v = jax.random.normal(key_v, v.shape, jnp.float32).astype(s.dtype)
  summary = paged_cache.page_score_fns(page_score).summary(k).astype(s.dtype)
  return paged_cache.to_stored(k), paged_cache.to_stored(v), summary


def filled_pool(cfg, pages: int, page_size: int, key, dtype=jnp.float32):
  pool = page_pool.init_pool(cfg, pages, page_size, dtype)
  layers = [
    _fill_pool_layer(k, v, s, jax.random.fold_in(key, i), page_score=pool.page_score)
    for i, (k, v, s) in enumerate(zip(pool.k_stored, pool.v_stored, pool.summaries))
  ]
  names = ("k_stored", "v_stored", "summaries")
  return pool.replace(**{n: tuple(x[j] for x in layers) for j, n in enumerate(names)})


def priced_plan(cfg, schedule, sparse, alpha_bin, bin_size, ks, rows, hardware, timings):
  """The regime switch's plan as the trainer prices it (`hooks.DraftSwitch`): measured per-bin
  acceptances, and the measured rounds of each setting, timings = {k: [(seconds per round, cached
  length), ...]} (k = 0: dense decode steps) -> (plan, the switch's pass overhead, its round
  scales)."""
  stats = types.SimpleNamespace(bin_size=bin_size, num_bins=len(alpha_bin))
  switch = hooks.DraftSwitch(cfg, sparse, rows, ks, stats, hardware)
  switch.alpha = [float(a) for a in alpha_bin]
  switch.reprice(timings, schedule)
  return switch.plan(schedule), switch.hardware.pass_overhead_s, switch.scale


def _row(setting, seconds, tokens, count=None, plan=None) -> dict:
  tokens = int(tokens)
  row = dict(setting=setting, seconds=seconds, tokens=tokens, tokens_per_s=tokens / seconds)
  if count is not None:
    emitted, rounds = int(np.sum(count["emitted"])), int(np.sum(count["rounds"]))
    judged, accepted = int(np.sum(count["judged"])), int(np.sum(count["accepted"]))
    row["accepted_per_round"] = emitted / max(rounds, 1)
    row["draft_acceptance"] = accepted / judged if judged else None
  if plan is not None:
    row["plan_k_bin"] = list(plan.k_bin)
  return row


def _keyed(scale: dict) -> dict:
  return {f"k{k}": s for k, s in sorted(scale.items())}


def _ratios(rows) -> list:
  dense = rows[0]["tokens_per_s"]
  for row in rows:
    row["vs_dense"] = float(row["tokens_per_s"] / dense)
    if "decode_tokens_per_s" in row:
      row["decode_vs_dense"] = row["decode_tokens_per_s"] / rows[0]["decode_tokens_per_s"]
  return rows


def round_dense_steps(row) -> float:
  """A round's seconds in dense decode steps (seconds per round / dense seconds per token) of a
  row of (1), where every row runs every round of a chunk: the tokens a round emits over the ratio
  to dense tokens/s. A decode step (dense, sparse) is a round that emits one token."""
  return row.get("accepted_per_round", 1.0) / row["vs_dense"]


def _print(label, rows):
  for row in rows:
    extra = ""
    if row.get("accepted_per_round") is not None:
      extra += f"  accepted/round {row['accepted_per_round']:.2f}"
    if "decode_vs_dense" in row:
      extra += (
        f"  decode alone {row['decode_tokens_per_s']:.1f} tok/s {row['decode_vs_dense']:.2f}x"
      )
    if "plan_k_bin" in row:
      extra += f"  plan {row['plan_k_bin']}"
    print(
      f"  {label:>8}  {row['setting']:11s} {row['tokens_per_s']:8.1f} tok/s"
      f"  {row['vs_dense']:.2f}x dense{extra}",
      flush=True,
    )


def bench_shapes(config, hardware, dtype=jnp.float32) -> list:
  """(1): the settings at each context of the random long-context model, its weights and pool in
  `dtype`."""
  e = config.shapes
  cfg = model_config(e.layers, e.vocab_size)
  params = qwen3.init_params(cfg, jax.random.PRNGKey(0), dtype=dtype)
  sparse = sj.SparseConfig(page_size=16, dense_layers=e.dense_layers)
  sampling = sampler.Sampling(temperature=config.temperature)
  B, Z, T, K = config.batch, sparse.page_size, e.steps, max(config.drafts)
  schedule = KVSchedule.paper("qwen3-1.7b", tau=e.tau)
  out = []
  print(f"(1) {cfg.num_hidden_layers} layers of qwen3-1.7b, random weights, batch {B}, {T} tokens")
  for context in e.contexts:
    PR = -(-(context + T + K + 2) // Z)
    state = {"pool": filled_pool(cfg, B * PR + 1, Z, jax.random.PRNGKey(1), dtype)}
    slots = dict(
      token=np.ones(B, np.int32),
      length=np.full(B, context, np.int32),
      n_gen=np.ones(B, np.int32),
      max_new=np.full(B, 10 * T, np.int32),
      row=np.arange(B, dtype=np.int32),
      active=np.ones(B, bool),
      page_table=np.arange(1, B * PR + 1, dtype=np.int32).reshape(B, PR),
    )
    budget = engine._budget(schedule, sparse, PR * Z)
    got = {}

    def chunk(name, k, budget=budget, speculative=True, dense=False):
      def call():
        key = jax.random.PRNGKey(2)
        kw = dict(cfg=cfg, sparse=None if dense else sparse, sampling=sampling)
        pool, params_, bud = state["pool"], params, None if dense else budget
        if speculative:
          rounds = -(-T // (k + 1))
          res = programs.speculative_chunk(
            params_, None, pool, bud, key, slots, rounds=rounds, draft=k, **kw
          )
          got[name] = (res[1]["n_gen"] - 1, res[2]["alpha"], res[4])
        else:
          res = programs.decode_chunk(params_, None, pool, bud, key, slots, steps=T, **kw)
          got[name] = (res[1]["n_gen"] - 1, None, None)
        state["pool"] = res[0]
        jax.block_until_ready(res[1]["n_gen"])

      return call

    names = ["dense", "dense again", "sparse"] + [f"speculate{k}" for k in config.drafts]
    calls = [chunk(n, 0, speculative=False, dense=n != "sparse") for n in names[:3]]
    calls += [chunk(f"speculate{k}", k) for k in config.drafts]
    # What the plan is priced at, measured first (as the trainer's earlier steps measure it): the
    # speculate runs' judged drafts' acceptance and every setting's seconds per round.
    ks = tuple(config.drafts)
    first = median_seconds(calls[:1] + calls[3:], 1)
    timings = {k: [(sec / -(-T // (k + 1)), context)] for k, sec in zip((0, *ks), first)}
    alpha = np.concatenate([np.asarray(got[n][1]).ravel() for n in names[3:]])
    alpha = float(np.nanmean(alpha))
    num_bins = context // e.bin_size + 1
    alpha_bin = [alpha] * num_bins
    plan, overhead, scale = priced_plan(
      cfg, schedule, sparse, alpha_bin, e.bin_size, ks, B, hardware, timings
    )
    by_len = np.minimum(plan.k_by_len(PR * Z), K)
    # The engine's choice of program: the most drafts a round takes, or none: dense decode steps.
    draft = int(by_len[context : context + T].max())
    auto_budget = budget.replace(draft_by_len=jnp.asarray(by_len))
    names.append("auto")
    calls.append(chunk("auto", draft, auto_budget, speculative=draft > 0, dense=draft == 0))
    seconds = median_seconds(calls, config.runs)
    rows = []
    for name, sec in zip(names, seconds):
      tokens, _, count = got[name]
      rows.append(
        _row(name, sec, np.sum(tokens), count, plan if name == "auto" else None)
        | dict(context=context)
      )
    rows[-1].update(measured_alpha=alpha, pass_overhead_s=overhead, round_scale=_keyed(scale))
    _print(str(context), _ratios(rows))
    out += rows
    state.clear()  # the pool goes before the next context's is made
  return out


def bench_trained(config, hardware) -> list:
  """(2): whole rollouts of the shipped tiny model on its own task's prompts."""
  c = config.trained
  task = build.make_task(c)
  cfg, params, tokenizer = build.load_model(c, task)
  r = c.rollout
  problems = task.sample(r.prompts_per_step, 0)
  ids = [tokenizer.encode(p.prompt) for p in problems for _ in range(r.group_size)]
  prompt, prompt_len = calibrate.pad_prompts(ids, tokenizer.pad_id)
  print(f"(2) {c.model.hf_dir}: {len(prompt_len)} rows of {r.max_new_tokens} tokens at most")
  return time_rollouts(config, c, cfg, params, tokenizer, prompt, prompt_len, "trained", hardware)


def long_prompts_refusal(c) -> str:
  """Why (3) cannot run with config.long_prompts `c`, in one line naming the field; "" when it
  can. Checked before anything else runs, so a missing model costs no time."""
  hf_dir = c.model.hf_dir
  if not hf_dir or not os.path.isfile(os.path.join(hf_dir, "config.json")):
    return (
      f"config.long_prompts.model.hf_dir = {hf_dir!r} is not a model dir (no config.json): "
      "import one (docs/real_lm.md) or set config.long_prompts.enabled=False"
    )
  limit = build.model_config(c).max_position_embeddings
  longest = max(c.lengths) + c.rollout.max_new_tokens
  if longest > limit:
    return (
      f"config.long_prompts.lengths = {tuple(c.lengths)} + rollout.max_new_tokens = "
      f"{c.rollout.max_new_tokens} reach {longest} positions, past the model's "
      f"max_position_embeddings ({limit})"
    )
  return ""


def bench_long_prompts(config, hardware) -> tuple:
  """(3): whole rollouts of a real model on long prompts cut from local text (data/long_prompts.py),
  one run of every setting per prompt length -> (rows, the prompts' sources)."""
  c = config.long_prompts
  cfg, params = sj.load_hf(c.model.hf_dir, dtype=jnp.dtype(c.model.dtype))
  tokenizer = load_tokenizer(c.model.hf_dir)
  prompts = long_prompts.build_long_prompts(
    tokenizer,
    lengths=c.lengths,
    rows=c.rows,
    directory=c.source_dir,
    pattern=c.pattern,
    instruction=c.instruction,
    chat=c.chat,
    system=c.system,
  )
  source_dir = c.source_dir or long_prompts.stdlib_dir()
  sources = {str(p.length): [] for p in prompts}
  rows = []
  for length in c.lengths:
    chosen = [p for p in prompts if p.length == length]
    sources[str(length)] = [list(p.sources) for p in chosen]
    prompt = np.repeat(np.stack([p.tokens for p in chosen]), c.group_size, axis=0)
    prompt_len = np.full(len(prompt), length, np.int32)
    at_length = c.copy_and_resolve_references()
    at_length.rollout.max_prompt_len = length
    at_length.rollout.group_size = c.group_size  # rows a prompt (its pages shared)
    print(f"(3) {c.model.hf_dir}: {len(chosen)} prompts of {length} tokens from {source_dir}")
    rows += time_rollouts(
      config, at_length, cfg, params, tokenizer, prompt, prompt_len, f"long{length}", hardware
    )
  return rows, dict(source_dir=source_dir, pattern=c.pattern, sources=sources)


def time_rollouts(config, c, cfg, params, tokenizer, prompt, prompt_len, label, hardware) -> list:
  """Whole rollouts of `prompt` (right-padded rows, their lengths) through `engine.run` under the
  run config `c` for dense, sparse, each speculateK and auto, interleaved, median over `runs`."""
  sparse = build.sparse_config(c)
  schedule = KVSchedule.parse(c.rollout.schedule, c.rollout.page_size)
  sampling = build.sampling(c, tokenizer)
  r = c.rollout
  requests = engine.Requests(prompt, prompt_len, r.max_new_tokens, r.group_size)
  rows_per_device = len(prompt_len)
  K = max(config.drafts)
  base = build.engine_config(c, cfg, rows_per_device)
  got, decode_s, program_s = {}, {}, {}

  def rollout(name, k=0, plan=None):
    setting = dataclasses.replace(base, speculate=k, draft_switch=plan is not None)

    def call():
      out, stats = engine.run(
        params,
        cfg,
        requests,
        jax.random.PRNGKey(3),
        engine=setting,
        sampling=sampling,
        sparse=None if name.startswith("dense") else sparse,
        schedule=None if name.startswith("dense") else schedule,
        draft_plan=plan,
      )
      got[name] = (out, stats)
      decode_s.setdefault(name, []).append(stats.decode_seconds)
      program_s.setdefault(name, []).append(stats.program_seconds)

    return call

  names = ["dense", "dense again", "sparse"] + [f"speculate{k}" for k in config.drafts]
  calls = [rollout(n) for n in names[:3]]
  calls += [rollout(f"speculate{k}", k) for k in config.drafts]
  # What the plan is priced at, measured first (as the trainer's earlier steps measure it): the
  # engine's seconds per round of dense decoding and of each k, and the drafts' acceptance per bin
  # on the largest k's rollout.
  median_seconds(calls[:1] + calls[3:], 1)
  measured = [got["dense"][1].round_timings()] + [
    got[f"speculate{k}"][1].round_timings() for k in config.drafts
  ]
  # a count timed in one chunk only (a short rollout) is not measured: the roofline prices it
  timings = {k: m[k] for k, m in zip((0, *config.drafts), measured) if k in m}
  out, _ = got[names[-1]]
  alpha_BN = np.asarray(out.alpha, np.float64)
  bins = (prompt_len[:, None] + np.arange(alpha_BN.shape[1])[None]) // c.stats.bin_size
  alpha_bin = [
    float(np.nanmean(alpha_BN[bins == b])) if np.any(~np.isnan(alpha_BN[bins == b])) else np.nan
    for b in range(c.stats.num_bins)
  ]
  plan, overhead, scale = priced_plan(
    cfg,
    schedule,
    sparse,
    alpha_bin,
    c.stats.bin_size,
    tuple(config.drafts),
    base.num_slots,
    hardware,
    timings,
  )
  names.append("auto")
  calls.append(rollout("auto", K, plan))
  # the settings measured above are warm already, and dense again runs dense's programs
  warm = {i for i, name in enumerate(names) if name not in ("sparse", "auto")}
  seconds = median_seconds(calls, config.runs, warm)
  rows = []
  for name, sec in zip(names, seconds):
    out, stats = got[name]
    row = _row(name, sec, np.sum(out.lengths), None, plan if name == "auto" else None)
    # Decode alone: the timed calls' decode chunks (the prefill samples each row's first token)
    decoded = np.sum(out.lengths) - len(out.lengths)
    decode = np.median(decode_s[name][-config.runs :])
    row["decode_tokens_per_s"] = float(decoded / decode)
    # the host's scheduling between chunks: decode time outside the chunks' programs
    row["decode_host_share"] = float(1 - np.median(program_s[name][-config.runs :]) / decode)
    if stats.rounds:
      row["accepted_per_round"] = stats.accepted_per_round
      row["draft_acceptance"] = None if not stats.judged else stats.draft_acceptance
    rows.append(row | dict(context=label))
  rows[-1]["measured_alpha_bin"] = [None if np.isnan(a) else a for a in alpha_bin]
  rows[-1].update(pass_overhead_s=overhead, round_scale=_keyed(scale))
  _print(label, _ratios(rows))
  return rows


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}: settings go in --config.FIELD=VALUE")
  config = flags.FLAGS.config
  refusal = config.long_prompts.enabled and long_prompts_refusal(config.long_prompts)
  if refusal:
    raise SystemExit(refusal)
  hardware = cost_model.get_hardware(config.hardware)
  print(f"the switch prices rounds on {hardware.name}", flush=True)
  rows = []
  if config.shapes.contexts:
    rows += bench_shapes(config, hardware)
  if config.trained.enabled:
    rows += bench_trained(config, hardware)
  sources = {}
  if config.long_prompts.enabled:
    long_rows, sources = bench_long_prompts(config, hardware)
    rows += long_rows
  if config.record:
    results = dict(config=config.to_dict(), hardware=dataclasses.asdict(hardware), rows=rows)
    if sources:
      results["long_prompts"] = sources
    records.write_record(os.path.join(ROOT, config.record), results)
    print(f"    record: {config.record}")


if __name__ == "__main__":
  # Defined here, not at import: tests import scripts beside others that define --config.
  config_flags.DEFINE_config_file("config", "configs/bench_exact.py", "experiment config")
  app.run(main)
