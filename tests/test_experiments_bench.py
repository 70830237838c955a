"""experiments/bench_attention.py, bench_decode.py, bench_tunix.py, bench_engine.py and
cost_report.py end to end: each script run as its README command (`--config=configs/X.py`) with
tiny overrides, checking that its tables and ratio lines are printed and that bad settings fail
naming the value; each `--config.out` record holds the rows its script prints, and
docs/make_results_pages.py renders those rows."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sparrow_jax as sj
from sparrow_jax.attention import paged_cache
from sparrow_jax.data import long_prompts
from tests.helpers import load_file, write_tiny_hf_dir

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load(script):
  return load_file(f"experiments/{script}.py")


def _run(script, *overrides, check=True):
  """Runs experiments/<script>.py --config=configs/<script>.py with overrides; returns the
  result."""
  cmd = [sys.executable, f"experiments/{script}.py", f"--config=configs/{script}.py", *overrides]
  result = subprocess.run(
    cmd,
    cwd=ROOT,
    env=dict(os.environ, JAX_PLATFORMS="cpu"),
    capture_output=True,
    text=True,
    timeout=300,
  )
  if check:
    assert result.returncode == 0, result.stderr[-3000:]
  return result


@pytest.mark.nightly
def test_cost_report_prints_both_tables_and_writes_them_as_a_record(tmp_path):
  """One run (`out` only adds the JSON record): its tables print, and the record holds them."""
  path = tmp_path / "cost_model.json"
  out = _run(
    "cost_report", "--config.measure=False", "--config.gen_len=4096", f"--config.out={path}"
  ).stdout
  assert "prompt 1024 tokens, generation 4096 tokens" in out
  assert "this_machine" not in out
  assert "Predicted rollout speedup" in out and "paper (4x H200)" in out
  assert "Page-size comparison on h200" in out and "page 128" in out
  assert "Static batch vs engine" in out and "engine/static" in out
  assert "Lossless (speculative) rollouts" in out and "k = 8" in out
  for model in ("qwen3-1.7b", "qwen3-4b", "qwen3-8b", "qwen3-14b"):
    rows = sum(line.startswith(model + " ") for line in out.splitlines())
    assert rows == 5 + 3, model  # a row in each of five tables, the speculative one's per alpha
  record = json.load(open(path))
  assert {"command", "commit", "machine", "date"} <= set(record)
  r = record["results"]
  assert r["config"]["gen_len"] == 4096 and r["config"]["out"] == str(path)
  models = ["qwen3-1.7b", "qwen3-4b", "qwen3-8b", "qwen3-14b"]
  for part in (r["comparison"]["models"], r["engine"], r["sensitivity"]["models"]):
    assert list(part) == models
  assert list(r["eflops_by_hardware"]["models"]) == models
  assert list(r["page_sizes"]["models"]) == models
  lines = out.splitlines()
  for model, m in r["comparison"]["models"].items():  # the printed rows are the record's
    row = next(line for line in lines if line.startswith(model + " "))
    assert f"{m['roofline']:.2f}x" in row and f"{m['roofline_error']:+.0%}" in row, row
  for model, m in r["sensitivity"]["models"].items():
    assert len(m["by_mean"]) == len(r["sensitivity"]["mean_len_fracs"])
    assert len(m["by_batch"]) == len(r["sensitivity"]["batches"])
  for m in r["engine"].values():
    assert {name: set(v) for name, v in m.items()} == {
      "static": {"dense", "sparse"},
      "engine": {"dense", "sparse"},
    }
  assert len(r["page_sizes"]["models"]["qwen3-4b"]) == len(r["page_sizes"]["page_sizes"])
  assert list(r["speculative"]["models"]) == models and r["speculative"]["ks"] == [2, 4, 8]
  for m in r["speculative"]["models"].values():
    assert [a["source"] for a in m["by_alpha"]] == ["bound: p5 >= tau", "paper", "paper"]
    assert all(list(a["by_k"]) == ["2", "4", "8"] for a in m["by_alpha"])
  page = _load_pages().cost_model_page([record])
  assert "different settings" in page  # a 4096-token cutoff is not the paper's
  assert f"{r['comparison']['models']['qwen3-8b']['roofline']:.2f}x" in page
  spec = r["speculative"]["models"]["qwen3-4b"]["by_alpha"][2]["by_k"]["4"]
  assert f"{spec['speedup']:.2f}x ({spec['tokens_per_round']:.2f})" in page


def _load_pages():
  return load_file("docs/make_results_pages.py")


def test_a_round_s_cost_in_dense_steps_is_read_on_the_verdict_s_clock():
  """Long prompts' rows are judged on decode alone (their prefill is the same in every setting):
  a round's cost in dense steps is its tokens over its decode-alone ratio, not the whole call's."""
  rows = [
    dict(context="long4096", setting=s, vs_dense=v, decode_vs_dense=d, accepted_per_round=a)
    for s, v, d, a in (
      ("dense", 1.0, 1.0, None),
      ("dense again", 1.0, 1.0, None),
      ("sparse", 1.1, 1.2, None),
      ("speculate2", 0.9, 0.8, 2.8),
      ("auto", 1.0, 1.0, None),
    )
  ]
  (verdict, rounds) = _load_pages()._exact_verdict(rows)
  assert "speculate2 a round costs 3.50 dense steps" in rounds, rounds


@pytest.mark.nightly
def test_bench_attention_prints_a_row_per_context_and_writes_them_as_a_record(tmp_path):
  """One run (the record's `out` only adds the JSON): a row per context, the record's rows."""
  path = tmp_path / "decode_attention.json"
  out = _run(
    "bench_attention",
    "--config.contexts=256,512",
    "--config.budget=64",
    "--config.steps=2",
    "--config.runs=1",
    f"--config.out={path}",
  ).stdout
  assert "budget 64 tokens (4 pages of 16)" in out and "median of 1 calls of 2 steps" in out
  assert "impl auto" in out and "batch 4" in out and "cache 512 tokens" in out
  lines = out.splitlines()
  header = next(i for i, line in enumerate(lines) if line.split()[:2] == ["context", "dense"])
  assert "min ratio" in lines[header] and "old ratio" in lines[header]
  assert "sparse+select" in lines[header]
  rows = [line.split() for line in lines[header + 1 :]]
  assert [r[0] for r in rows] == ["256", "512"]
  assert all(len(r) == 11 and r[6].endswith("x") and r[10].endswith("x") for r in rows), rows
  assert all(float(r[2]) > 0 and float(r[4]) > 0 for r in rows), rows  # GB/s
  record = json.load(open(path))
  assert {"command", "commit", "machine", "date"} <= set(record)
  r = record["results"]
  assert r["config"]["budget"] == 64 and r["cache_tokens"] == 512
  assert [row["context"] for row in r["rows"]] == [256, 512]
  printed = out.splitlines()[2:]
  assert printed == [_load("bench_attention").format_row(row) for row in r["rows"]]
  page = _load_pages().decode_attention_page([record])
  for row in r["rows"]:
    assert f"| {row['context']} | {row['dense_ms']:.3f} | " in page
    assert f"**{row['ratio']:.1f}x** | {row['min_ratio']:.1f}x | " in page
    assert f"| {row['select_ms']:.3f} | {row['select_ratio']:.1f}x | " in page


@pytest.mark.nightly
def test_bench_decode_filled_cache_is_a_prefilled_cache():
  """The random cache bench_decode decodes from: keys/values in slots [0, context), page centroids
  of exactly those keys, nothing after, lengths = context."""
  cfg = sj.Qwen3Config(**_load("bench_tunix").TINY, max_position_embeddings=64)
  caches = _load("bench_decode").filled_cache(cfg, 2, 32, 3, 16, np.float32, jax.random.PRNGKey(0))
  assert len(caches) == cfg.num_hidden_layers
  for cache in caches:
    np.testing.assert_array_equal(cache.lengths, [32, 32])
    k, v = np.asarray(cache.keys(0)), np.asarray(cache.values(0))
    centroids = np.asarray(cache.summaries[0, :, :, :, 0])  # "mean": one row, the mean key
    assert k.shape == (2, cfg.num_key_value_heads, 48, cfg.head_dim) and centroids.shape[2] == 3
    assert np.all(k[:, :, 32:] == 0) and np.all(v[:, :, 32:] == 0)
    assert np.all(centroids[:, :, 2:] == 0)
    assert 0.9 < k[:, :, :32].std() < 1.1 and 0.9 < v[:, :, :32].std() < 1.1
    np.testing.assert_allclose(
      centroids[:, :, :2], k[:, :, :32].reshape(2, -1, 2, 16, cfg.head_dim).mean(axis=3), atol=1e-6
    )


@pytest.mark.nightly
def test_bench_decode_prints_a_row_per_dense_layers_and_writes_a_record(tmp_path):
  """With `out`: a row per dense_layers, its printed rows are the record's and the page's."""
  path = tmp_path / "decode_rollout.json"
  out = _run(
    "bench_decode",
    "--config.decode.layers=1",
    "--config.decode.dense_layers=1,0",
    "--config.decode.contexts=256",
    "--config.decode.steps=2",
    "--config.batch=1",
    "--config.runs=1",
    f"--config.out={path}",
  ).stdout
  assert "decode only" in out and "truncated to 1 layers" in out and "this machine:" in out
  lines = out.splitlines()
  header = next(i for i, line in enumerate(lines) if line.split()[:2] == ["context", "budget"])
  assert "cost model" in lines[header] and "+weights" in lines[header]
  rows = [line.split() for line in lines[header + 1 : header + 3]]  # the step split follows
  assert [(r[0], r[2]) for r in rows] == [("256", "1"), ("256", "0")]
  assert all(len(r) == 8 and r[5].endswith("x") and r[7].endswith("x") for r in rows), rows
  assert lines[header + 3].split()[:1] != ["256"]  # no third row
  record = json.load(open(path))
  assert {"command", "commit", "machine", "date"} <= set(record)
  r = record["results"]
  assert "tunix" not in r
  assert r["config"]["decode"]["contexts"] == [256] and r["decode"]["layers"] == 1
  rows = r["decode"]["rows"]
  assert [(row["context"], row["dense_layers"]) for row in rows] == [(256, 1), (256, 0)]
  bench_decode = _load("bench_decode")
  assert all(bench_decode.format_decode_row(row) in lines for row in rows), out
  (split,) = r["decode"]["split"]  # the row with the fewest dense layers, d = 0
  assert split["context"] == 256 and bench_decode.format_split(split) in lines, out
  assert all(np.isfinite(v) for v in split.values()), split  # differences of times: any sign
  page = _load_pages().decode_rollout_page([record])
  assert f"| 256 | {split['rest_ms']:.1f} | {split['weights_gbs']:.1f} |" in page, page
  assert "## End-to-end decode" in page and "## Against tunix" not in page
  for row in rows:
    assert (
      f"| 256 | {row['budget']} | {row['dense_layers']} of 1 | {row['dense_tok_s']:.2f} | "
      f"{row['sparse_tok_s']:.2f} | **{row['ratio']:.2f}x** | {row['cost_model']:.2f}x | "
      f"{row['with_weights']:.2f}x |"
    ) in page


@pytest.mark.nightly
def test_bench_tunix_reruns_under_tunix_python_and_records_only_what_ran(tmp_path):
  """With tunix.python set the script reruns there: in an interpreter without google-tunix it says
  how to make one (with tunix it runs the tiny comparison instead), and writes no record; with
  tunix, the record holds the comparison and the page shows it alone."""
  path = tmp_path / "decode_rollout.json"
  out = _run(
    "bench_tunix",
    f"--config.tunix.python={sys.executable}",
    "--config.tunix.prompt=8",
    "--config.tunix.gen=2,4",
    "--config.batch=1",
    "--config.runs=1",
    f"--config.out={path}",
  ).stdout
  assert (
    "skipped" in out and "--config.tunix.python=VENV/bin/python" in out or "ours / tunix:" in out
  ), out
  assert path.exists() == ("ours / tunix:" in out)
  if path.exists():
    record = json.load(open(path))
    assert "decode" not in record["results"]
    page = _load_pages().decode_rollout_page([record])
    assert "## End-to-end decode" not in page and "## Against tunix" in page


@pytest.mark.nightly
def test_tunix_figures_print_and_render_alike(capsys):
  """bench_tunix's figures, from made-up call times (google-tunix is not a dependency): what the
  script prints and what the page shows are the same figures."""
  bench_tunix = _load("bench_tunix")
  ours, theirs = bench_tunix.SAMPLERS
  samplers = bench_tunix.sampler_figures(
    4, (32, 160), {ours: (0.5, 1.2), theirs: (0.6, 1.5)}, read_ms=4.0
  )
  assert samplers[ours]["tok_s"] == pytest.approx(4 * 128 / 0.7)
  assert samplers[theirs]["step_ms"] == pytest.approx(1e3 * 0.9 / 128)
  fig = dict(
    model=dict(layers=4, hidden_size=512, heads=8, kv_heads=4, vocab_size=8192),
    batch=4,
    prompt=64,
    gen=[32, 160],
    runs=5,
    samplers=samplers,
    step_split={"no attention": 3.1, "page gather alone": 4.4},
    weight_bytes=67_100_000,
    weight_read_ms=4.0,
    ours_over_tunix=samplers[ours]["tok_s"] / samplers[theirs]["tok_s"],
    same_tokens=640,
    tokens=640,
    tokens_per_row=dict(ours=160, tunix=160),
    versions=dict(tunix="0.0", jax="0.0", python="3"),
  )
  bench_tunix.print_tunix(fig)
  printed = capsys.readouterr().out
  record = dict(command="python x", commit="0" * 40, machine="m", date="d")
  page = _load_pages().decode_rollout_page([record | dict(results=dict(config={}, tunix=fig))])
  assert "## End-to-end decode" not in page and "## Against tunix" in page
  for s in samplers.values():
    assert f"{s['tok_s']:.1f}" in printed and f"| {s['tok_s']:.1f} | {s['step_ms']:.2f} |" in page
  ratio = f"{fig['ours_over_tunix']:.2f}x"
  assert f"ours / tunix: {ratio}" in printed and f"Ours / tunix: **{ratio}**" in page
  assert "same greedy tokens: 640/640" in printed and "same greedy tokens: 640/640" in page
  assert "3.10 ms with no attention, 4.40 ms with the page gather alone" in printed
  assert "| 3.10 (0.78x) | 4.40 (1.10x) |" in page


@pytest.mark.nightly
def test_step_probes_replace_the_engines_attention_and_nothing_after():
  """bench_tunix's step split: each stand-in changes what the engine's decode computes (so it took
  the attention's place), and the engine's own decode is unchanged after and between them."""
  bench_tunix = _load("bench_tunix")
  cfg = sj.Qwen3Config(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=64,
  )
  params = sj.init_params(cfg, jax.random.PRNGKey(0))
  prompt_BT = np.random.default_rng(0).integers(1, 64, (2, 20)).astype(np.int32)

  def run():
    return np.asarray(
      sj.generate(
        params,
        cfg,
        prompt_BT,
        np.full((2,), 20, np.int32),
        jax.random.PRNGKey(0),
        max_new_tokens=12,
        sampling=sj.Sampling(temperature=0.0),
      ).tokens
    )

  before = run()
  for attention in bench_tunix.STEP_PROBES.values():
    probed = bench_tunix.with_attention(run, attention)
    assert not np.array_equal(probed(), before)
    np.testing.assert_array_equal(run(), before)


@pytest.mark.nightly
@pytest.mark.parametrize(
  "script, override, message",
  [
    ("bench_attention", "--config.budget=40", "budget must be a multiple of 16"),
    ("bench_attention", "--config.impl=triton", "impl must be one of"),
    ("bench_attention", "--config.cache_tokens=1000", "got 1000"),
    ("bench_attention", "--config.contexts=2048,2056", "got [2056]"),
    ("bench_decode", "--config.decode.contexts=100", "got [100]"),
    ("bench_decode", "--config.decode.dense_layers=5", "decode.layers=4], got (5,)"),
    ("bench_engine", "--config.engine.settings=batch", "engine.settings takes"),
  ],
)
def test_bad_settings_fail_naming_the_value(script, override, message):
  result = _run(script, *override.split(), check=False)
  assert result.returncode != 0 and message in result.stderr, result.stderr[-2000:]


@pytest.mark.nightly
def test_bench_engine_runs_both_settings_and_writes_its_record(tmp_path):
  """At toy size: the static batch and the engine, dense and sparse, run the same forced lengths
  over one pool; the record carries its provenance."""
  record = tmp_path / "engine.json"
  # equal slot counts: both settings share compiled shapes; they differ in scheduling alone
  out = _run(
    "bench_engine",
    "--config.engine.prompts=2",
    "--config.engine.group_size=4",
    "--config.engine.cutoff=96",
    "--config.engine.static_slots=4",
    "--config.engine.slots=4",
    "--config.engine.chunk_steps=8",
    f"--config.engine.record={record}",
  ).stdout
  assert out.count(" static ") == 2 and out.count(" engine ") == 2, out
  report = json.loads(record.read_text())
  assert {"command", "commit", "machine", "date"} <= set(report)
  runs = report["results"]["runs"]
  assert {r["peak_pages"] for r in runs.values()} and all(
    r["peak_pages"] < report["results"]["pool_pages"] for r in runs.values()
  )
  assert runs["dense/engine"]["rows_in_flight"] > runs["dense/static"]["rows_in_flight"]
  assert set(report["results"]["ratios"]) >= {"engine/static dense", "sparse/dense engine"}


@pytest.mark.nightly
def test_bench_exact_times_every_setting_and_renders_its_verdicts(tmp_path):
  """bench_exact at toy size: a row per setting and shape, in the record as printed, the switch's
  plan in its row, and the page's verdict lines from them."""
  path = tmp_path / "speculative_rollout.json"
  out = _run(
    "bench_exact",
    "--config.shapes.contexts=512",
    "--config.shapes.layers=1",
    "--config.shapes.steps=4",
    "--config.shapes.bin_size=256",
    "--config.runs=1",
    "--config.hardware=h200",
    "--config.trained.rollout.prompts_per_step=1",
    "--config.trained.rollout.group_size=2",
    "--config.trained.rollout.max_new_tokens=24",
    f"--config.record={path}",
  ).stdout
  record = json.load(open(path))
  rows = record["results"]["rows"]
  settings = ["dense", "dense again", "sparse", "speculate2", "speculate4", "auto"]
  assert [r["setting"] for r in rows] == settings * 2
  assert [r["context"] for r in rows] == [512] * 6 + ["trained"] * 6
  for row in rows:
    assert f"{row['setting']:11s} {row['tokens_per_s']:8.1f} tok/s" in out
  assert all("plan_k_bin" in r for r in rows if r["setting"] == "auto")
  page = load_file("docs/make_results_pages.py").speculative_rollout_page([record])
  assert page.count("never slower than dense") == 2


@pytest.mark.slow
def test_bench_exact_refuses_long_prompts_without_what_they_need(tmp_path):
  """Part (3) needs a model dir whose positions hold the longest prompt and its new tokens: without
  either the run stops in one line naming the field, before any part runs."""
  result = _run(
    "bench_exact",
    "--config.long_prompts.enabled=True",
    f"--config.long_prompts.model.hf_dir={tmp_path / 'absent'}",
    check=False,
  )
  assert result.returncode != 0 and "(1)" not in result.stdout, result.stdout[-2000:]
  assert result.stderr.strip().splitlines() == [
    f"config.long_prompts.model.hf_dir = '{tmp_path / 'absent'}' is not a model dir (no "
    "config.json): import one (docs/real_lm.md) or set config.long_prompts.enabled=False"
  ]
  write_tiny_hf_dir(tmp_path / "tiny", num_hidden_layers=1)  # 1024 positions
  c = load_file("configs/bench_exact.py").get_config().long_prompts
  c.model.hf_dir = str(tmp_path / "tiny")
  refusal = _load("bench_exact").long_prompts_refusal
  c.lengths, c.rollout.max_new_tokens = (512, 1000), 32
  assert refusal(c) == (
    "config.long_prompts.lengths = (512, 1000) + rollout.max_new_tokens = 32 reach 1032 "
    "positions, past the model's max_position_embeddings (1024)"
  )
  c.lengths = (512, 992)
  assert refusal(c) == ""


def test_bench_exact_fills_a_bfloat16_pool_through_its_stored_form():
  """filled_pool in bfloat16 on this CPU, where keys and values are stored as their uint16 bits:
  the bits read back as unit-normal draws, and each page's summary is its keys' mean."""
  bench_exact = _load("bench_exact")
  cfg = bench_exact.model_config(1, 64)
  pool = bench_exact.filled_pool(cfg, 3, 16, jax.random.PRNGKey(0), jnp.bfloat16)
  assert pool.k_stored[0].dtype == paged_cache.stored_dtype(jnp.bfloat16)
  for stored in (pool.k_stored[0], pool.v_stored[0]):
    values = paged_cache.from_stored(stored, jnp.bfloat16).astype(jnp.float32)
    assert 0.9 < float(jnp.std(values)) < 1.1 and abs(float(jnp.mean(values))) < 0.1
  keys = paged_cache.from_stored(pool.k_stored[0], jnp.bfloat16).astype(jnp.float32)
  mean = keys.mean(axis=3, keepdims=True).astype(jnp.bfloat16)
  np.testing.assert_array_equal(np.asarray(pool.summaries[0]), np.asarray(mean))


@pytest.mark.nightly
def test_bench_exact_times_every_setting_on_long_prompts_of_real_text(tmp_path):
  """Part (3) alone at toy size on a tiny random model dir: every setting at each prompt length,
  the record naming the standard-library files each prompt holds."""
  write_tiny_hf_dir(tmp_path / "tiny", num_hidden_layers=3)
  path = tmp_path / "long.json"
  out = _run(
    "bench_exact",
    "--config.shapes.contexts=()",
    "--config.trained.enabled=False",
    "--config.runs=1",
    "--config.hardware=h200",
    "--config.long_prompts.enabled=True",
    f"--config.long_prompts.model.hf_dir={tmp_path / 'tiny'}",
    "--config.long_prompts.lengths=96,160",
    "--config.long_prompts.rows=2",
    "--config.long_prompts.group_size=2",
    "--config.long_prompts.rollout.max_new_tokens=12",
    "--config.long_prompts.stats.bin_size=64",
    f"--config.record={path}",
  ).stdout
  results = json.load(open(path))["results"]
  settings = ["dense", "dense again", "sparse", "speculate2", "speculate4", "auto"]
  assert [(r["context"], r["setting"]) for r in results["rows"]] == [
    (f"long{n}", s) for n in (96, 160) for s in settings
  ]
  assert all(r["draft_acceptance"] is not None for r in results["rows"] if "spec" in r["setting"])
  assert all(r["decode_tokens_per_s"] > 0 for r in results["rows"]), results["rows"]
  assert "(3)" in out and "2 prompts of 160 tokens" in out
  page = _load_pages().speculative_rollout_page([json.load(open(path))])
  assert "- long160 (decode alone): auto" in page and "the best fixed k, speculate" in page, page
  sources = results["long_prompts"]["sources"]
  assert set(sources) == {"96", "160"} and len(sources["160"]) == 2
  assert results["long_prompts"]["source_dir"] == "$STDLIB"  # no machine path in a record
  stdlib = long_prompts.stdlib_dir()
  assert all(os.path.isfile(os.path.join(stdlib, f)) for row in sources["160"] for f in row)


@pytest.mark.nightly
def test_bench_train_step_times_both_settings_and_writes_its_record(tmp_path):
  """At toy size: the full-length and the bucketed step run the same rows; the record carries the
  micro-batches' buckets, which the long-tailed rows spread over more than one."""
  record = tmp_path / "buckets.json"
  out = _run(
    "bench_train_step",
    "--config.prompts=1",
    "--config.group_size=4",
    "--config.prompt=32",
    "--config.cutoff=64",
    "--config.micro_batches=2",
    "--config.length_buckets=(48,64)",
    "--config.runs=1",
    f"--config.out={record}",
  ).stdout
  assert "full:" in out and "bucketed:" in out, out
  report = json.loads(record.read_text())
  assert {"command", "commit", "machine", "date"} <= set(report)
  r = report["results"]
  assert set(r["times"]) == {"full", "bucketed"} and r["speedup"] > 0
  assert all(b in (48, 64, 96) for b in r["micro_batch_buckets"]), r["micro_batch_buckets"]


@pytest.mark.nightly
def test_memory_report_compiles_each_part_without_allocating(tmp_path):
  """Qwen3-0.6B at full width, 3 of its layers (2 dense, 1 sparse; a full-depth compile is what the
  script is for, the test checks the parts and figures), 512-token rows: every table prints and the
  JSON holds the rollout's pool."""
  out_file = tmp_path / "memory.json"
  out = _run(
    "memory_report",
    "--config.models=qwen3-0.6b",
    "--config.lengths=512",
    "--config.prompt_len=128",
    "--config.parts=sampler,calibrate",
    "--config.layers=3",
    "--config.schedule=fixed:16",  # no published table for 0.6B
    f"--config.out={out_file}",
  ).stdout
  assert "rollout (the engine's full batch), 8 rows in groups of 8, prompt 128" in out
  assert "calibration pass" in out
  import json

  record = json.loads(out_file.read_text())
  assert "memory_report.py" in record["command"] and record["commit"]  # a results record
  report = record["results"]
  # the pool: 8 rows x 32 pages of 16 tokens + a template page + the trash page, keys, values
  # and mean-key summaries (1 row) of 3 layers x 8 KV heads x 128 dims in bfloat16
  kv = report["sampler/qwen3-0.6b/512"]["kv_gb"]
  assert abs(kv - (8 * 32 + 2) * 3 * 8 * (2 * 16 + 1) * 128 * 2 / 1e9) < 1e-6
  assert report["sampler/qwen3-0.6b/512"]["ratio"] > 1.0
  bad = _run("memory_report", "--config.parts=train,speed", check=False)
  assert bad.returncode != 0 and "speed" in bad.stderr
  tpu = _run("memory_report", "--config.parts=engine", "--config.target=v5p:2x2x1", check=False)
  assert tpu.returncode != 0 and "compiles the parts train and sampler" in tpu.stderr


def _run_device_check(*args):
  """experiments/device_check.py with `args` on this CPU; returns the finished process."""
  return subprocess.run(
    [sys.executable, "experiments/device_check.py", *args],
    cwd=ROOT,
    env=dict(os.environ, JAX_PLATFORMS="cpu"),
    capture_output=True,
    text=True,
    timeout=300,
  )


@pytest.mark.nightly
def test_device_check_smoke_runs_every_part(tmp_path):
  """The accelerator check at smoke sizes on this CPU (kernels in interpret mode): every kernel
  matches its twin, and the attention, decode, engine, training-attention and exact-mode tables
  are measured."""
  out = tmp_path / "device_check.json"
  result = _run_device_check("--smoke", f"--out={out}")
  assert result.returncode == 0, result.stderr[-3000:]
  report = json.loads(out.read_text())
  assert report["smoke"] and report["backend"] == "cpu"
  kernels = {(r["kernel"].split()[0], r["dtype"]) for r in report["kernels"]}
  assert kernels == {(k, d) for k in ("triton", "mosaic") for d in ("float32", "bfloat16")}
  assert all(r["ok"] and r["max_abs_diff"] < 1e-2 for r in report["kernels"]), report["kernels"]
  assert [r["context"] for r in report["attention"]["rows"]] == [256, 512]
  assert all(
    r[n]["ms"] > 0
    for r in report["attention"]["rows"]
    for n in ("dense", "whole cache", "sparse", "sparse+select")
  )
  assert report["decode"]["dense"]["tok_s"] > 0 and report["decode"]["sparse"]["temp_gb"] > 0
  assert set(report["engine"]["runs"]) == {"dense/engine", "sparse/engine"}
  assert report["engine"]["ratios"]["sparse/dense engine"] > 0
  train = report["train_attention"]  # on CPU "auto" is the blockwise path: the same numbers
  assert train["auto_ms"] > 0 and train["blockwise_ms"] > 0 and train["max_abs_diff"] == 0.0
  assert {"dense", "speculate2", "speculate4", "auto"} <= {
    r["setting"] for r in report["exact"]["rows"]
  }
  assert "| kernel | dtype |" in result.stdout and "sparse / dense:" in result.stdout
  assert "| exact | 256 speculate2 " in result.stdout
  assert result.stdout.rstrip().endswith("|")  # the summary table comes last


@pytest.mark.nightly
def test_device_check_finishes_when_a_part_fails(tmp_path, capsys, monkeypatch):
  """A part that raises prints its traceback; the parts after it still run, the JSON (rewritten
  after every part) holds every part, and the summary names the failure."""
  monkeypatch.syspath_prepend(os.path.join(ROOT, "experiments"))  # as when run as a script
  device_check = _load("device_check")
  out = tmp_path / "report.json"
  report = {}

  def broken(config):
    raise ValueError("engine.model must be 'default' or 'qwen3-1.7b', got 'bogus'")

  device_check.run_parts(
    [
      ("kernels", lambda c: [dict(ok=True)]),
      ("engine", broken),
      ("decode", lambda c: {"dense": {"tok_s": 2.0}, "sparse": {"tok_s": 3.0}}),
    ],
    None,
    report,
    str(out),
  )
  written = json.loads(out.read_text())
  assert "engine.model must be" in written["engine"]["error"]
  assert written["decode"]["sparse"]["tok_s"] == 3.0 and set(written["part_seconds"]) == {
    "kernels",
    "engine",
    "decode",
  }
  assert "Traceback" in capsys.readouterr().out
  summary = device_check._summary(report)
  assert "| engine | failed: ValueError: engine.model must be" in summary
  assert "| kernels | 1/1 equal their twin |" in summary and "sparse / dense 1.50x" in summary


@pytest.mark.slow
def test_device_check_exact_part_alone_reports_each_setting(tmp_path):
  """Part (6) alone (`--config.parts=exact`) at smoke sizes: a row per setting with its tokens/s,
  ratio to dense and round cost, the drafting settings' acceptance within [0, 1], and the
  summary's line for the part."""
  out = tmp_path / "device_check.json"
  result = _run_device_check(
    "--config=configs/device_check.py:smoke", "--config.parts=exact", f"--out={out}"
  )
  assert result.returncode == 0, result.stderr[-3000:]
  report = json.loads(out.read_text())
  assert set(report["part_seconds"]) == {"exact"}
  rows = {r["setting"]: r for r in report["exact"]["rows"]}
  assert {"dense", "speculate2", "speculate4", "auto"} <= set(rows)
  assert all(r["context"] == 256 and r["tokens_per_s"] > 0 for r in rows.values())
  assert rows["dense"]["vs_dense"] == 1.0 and rows["dense"]["round_dense_steps"] == 1.0
  for k in (2, 4):
    r = rows[f"speculate{k}"]
    assert 0 <= r["draft_acceptance"] <= 1, r
    assert 1 <= r["accepted_per_round"] <= k + 1 and r["round_dense_steps"] > 0, r
  assert rows["auto"]["plan_k_bin"]  # the switch's drafts per position bin
  alpha = rows["auto"].get("draft_acceptance")
  assert alpha is None or 0 <= alpha <= 1  # None: its plan decodes densely here
  summary = result.stdout[result.stdout.rindex("| part | result |") :]
  line = next(x for x in summary.splitlines() if x.startswith("| exact |"))
  for name in ("speculate2", "speculate4", "auto"):
    assert f"256 {name} {rows[name]['vs_dense']:.2f}x" in line, line
  for k in (2, 4):
    assert f"(acceptance {rows[f'speculate{k}']['draft_acceptance']:.2f})" in line, line


def test_device_check_parts_run_in_their_order_and_an_unknown_one_is_refused(monkeypatch):
  """config.parts picks parts by name, run in the check's own order (tuning on a GPU only); an
  unknown name is refused naming the field and the parts."""
  monkeypatch.syspath_prepend(os.path.join(ROOT, "experiments"))  # as when run as a script
  device_check = _load("device_check")
  names = lambda spec, backend: [n for n, _ in device_check.chosen_parts(spec, backend)]
  assert names("exact,kernels,tuning", "cpu") == ["kernels", "exact"]
  assert names("exact,kernels,tuning", "gpu") == ["kernels", "tuning", "exact"]
  with pytest.raises(ValueError, match=r"config.parts: unknown part\(s\) \['bogus'\]; the parts"):
    device_check.chosen_parts("kernels,bogus", "cpu")


@pytest.mark.nightly
def test_bench_async_runs_each_setting_and_renders_its_page(tmp_path):
  """bench_async at toy size: a row per setting in the order run, its steps version-tagged (one
  step off: the first two steps sampled with the first weights; partial rollouts: token lags
  logged), and the page's table from it."""
  path = tmp_path / "async_rl.json"
  out = _run(
    "bench_async",
    "--config.steps=3",
    "--config.jobs=long_tail",
    f"--config.workdir={tmp_path / 'runs'}",
    "--config.long_tail.rollout.prompts_per_step=1",
    "--config.long_tail.rollout.group_size=4",
    "--config.long_tail.rollout.max_new_tokens=30",
    f"--config.record={path}",
  ).stdout
  rows = json.load(open(path))["results"]["rows"]
  assert [r["setting"] for r in rows] == [
    "sync",
    "one_step_off",
    "one_step_off + partial",
    "one_step_off + partial, carry bound 1",
    "one_step_off + partial, no carry bound",
    "sync again",
  ]
  tags = lambda r: [s["rollout/weights_step"] for s in r["steps"]]
  assert tags(rows[0]) == [0, 1, 2] and all(tags(r) == [0, 0, 1] for r in rows[1:5])
  assert all("rollout/token_lag/mean" in s for r in rows[2:5] for s in r["steps"])
  assert all(0 <= r["idle_share"] <= 1 for r in rows) and "trainer idle" in out
  page = load_file("docs/make_results_pages.py").async_rl_page([json.load(open(path))])
  assert page.count("| one_step_off |") == 1 and page.count("| sync") == 2
  assert "**long_tail**" in page and "Length bias: trained mean response length, sync" in page
  bound = lambda name: next(x for x in page.splitlines() if x.startswith(f"| {name} |"))
  assert "| 2 |" in bound("one_step_off + partial") and "| 1 |" in bound(
    "one_step_off + partial, carry bound 1"
  )
  assert "| 0 |" in bound("one_step_off + partial, no carry bound")


def test_profile_decode_files_every_op_of_a_sparse_step_under_its_part(tmp_path):
  """On a tiny model: the dense step has dense attention and no page reads; the sparse step's
  selection, gather and attention each take time (the named scopes reach the compiled ops), and
  the record renders as the page's rows."""
  model_dir = tmp_path / "tiny"
  write_tiny_hf_dir(str(model_dir))
  path = tmp_path / "decode_profile.json"
  out = _run(
    "profile_decode",
    f"--config.model_dir={model_dir}",
    "--config.schedule=fixed:3",
    "--config.dense_layers=1",
    "--config.context=128",
    "--config.batch=2",
    "--config.steps=2",
    "--config.runs=1",
    f"--config.out={path}",
  ).stdout
  assert "sparse / dense:" in out, out
  record = json.load(open(path))
  modes = record["results"]["modes"]
  parts = {mode: {r["part"]: r["ms"] for r in modes[mode]["rows"]} for mode in modes}
  assert parts["dense"]["dense attention"] > 0 and "page gather" not in parts["dense"]
  for part in ("dense attention", "page selection", "page gather", "sparse attention"):
    assert parts["sparse"][part] > 0, (part, parts["sparse"])
  assert parts["sparse"]["weight matmuls"] > 0 and parts["dense"]["cache append"] > 0
  page = _load_pages().decode_profile_page([record])
  row = next(r for r in modes["sparse"]["rows"] if r["part"] == "page gather")
  assert f"| page gather | - | - | - | - | {row['ms']:.1f} | " in page, page


def test_sparse_read_layouts_times_each_way_against_the_reference(tmp_path):
  """Every way of reading the pages is checked against the reference before it is timed (the
  script fails on a wrong one) and has its row in the record."""
  path = tmp_path / "layouts.json"
  out = _run(
    "sparse_read_layouts",
    "--config.batch=2",
    "--config.context=256",
    "--config.pages=4",
    "--config.runs=1",
    f"--config.out={path}",
  ).stdout
  rows = json.load(open(path))["results"]["rows"]
  assert len(rows) == 10 and all(r["ms"] > 0 for r in rows), rows
  assert all(r["layout"] in out for r in rows), out


def test_bench_multiturn_runs_every_setting_on_episodes_and_renders_its_page(tmp_path):
  """At toy size (the multi-turn default's tiny model, 2 problems, short observations): every
  setting rolls out episodes that call the tool, lossy sparse reads less KV a model token than
  dense, and the slow-tool rows carry their stalled bound."""
  path = tmp_path / "workload.json"
  out = _run(
    "bench_multiturn",
    "--config.runs=1",
    "--config.slow_tool_s=0.2",
    "--config.run.env.decoys=8",
    "--config.run.rollout.max_new_tokens=384",
    "--config.run.rollout.prompts_per_step=2",
    "--config.run.rollout.group_size=2",
    "--config.run.rollout.schedule=fixed:4",
    f"--config.out={path}",
  ).stdout
  record = json.load(open(path))
  rows = {r["setting"]: r for r in record["results"]["rows"]}
  assert list(rows) == [
    "dense",
    "dense again",
    "sparse",
    "speculate4",
    "dense, slow tools",
    "sparse, slow tools",
  ], out
  assert all(r["tool_calls"] > 0 and r["model_tokens"] > 0 for r in rows.values()), rows
  assert rows["sparse"]["kv_read_vs_dense"] < 1 and rows["dense"]["kv_read_vs_dense"] == 1
  assert rows["speculate4"]["draft_acceptance"] is not None
  assert rows["dense, slow tools"]["stalled_bound_s"] > rows["dense"]["seconds"]
  page = _load_pages().multi_turn_workload_page([record])
  assert f"| sparse | {rows['sparse']['seconds']:.1f} | " in page, page
