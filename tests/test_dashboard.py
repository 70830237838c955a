"""What TensorBoard opens on (sparrow_jax.dashboard), read by TensorBoard's own plugins from the
events MetricsLogger writes: the Custom Scalars layout and a point in every tag it names, no point
for a bin without tokens, and each run's hyperparameters and summary metrics in the HParams tab.
Real runs' tags against the layout: tests/test_speculative.py and test_async_rl.py (their rows,
`assert_dashboard_has_data`), tests/test_trainer.py (the small run's events, through the plugin)."""

import json

import numpy as np
import pytest
from tensorboard import context
from tensorboard.backend.event_processing import data_provider, plugin_event_multiplexer
from tensorboard.plugins import base_plugin
from tensorboard.plugins.custom_scalar import custom_scalars_plugin
from tensorboard.plugins.hparams import api_pb2, backend_context, list_session_groups
from tensorboard.plugins.scalar import scalars_plugin
from tensorboardX import SummaryWriter

from configs import default
from configs import tau_sweep as sweep_config
from experiments import tau_sweep
from sparrow_jax import dashboard
from sparrow_jax.logging import MetricsLogger
from tests.helpers import assert_dashboard_has_data

COUNT_BIN = np.array([0, 0, 0, 840, 3544, 2512, 1717])  # the prompt fills bins 0-2: no tokens there
COUNT_TURN = np.array([5100, 2400, 1111, 0, 0, 0, 0, 0])  # no row reached a fourth turn
STATS = ("p1", "p5", "p10", "p50", "mean", "frac_above_0999", "frac_below_tau")


def _family(name, alpha):
  """A step's acceptance family as a multi-turn run's train step logs it: scalars, per-bin and
  per-turn arrays (NaN and a 0 count where a bin or turn has no tokens) and a histogram."""
  out = {f"{name}/{stat}": alpha for stat in STATS}
  out.update({f"{name}/{stat}_bin": np.where(COUNT_BIN > 0, alpha, np.nan) for stat in STATS})
  out.update({f"{name}/count": float(COUNT_BIN.sum()), f"{name}/count_bin": COUNT_BIN})
  out.update({f"{name}/{stat}_turn": np.where(COUNT_TURN > 0, alpha, np.nan) for stat in STATS})
  out[f"{name}/count_turn"] = COUNT_TURN
  out[f"{name}/histogram"] = np.arange(20)
  return out


def _metrics(step, tau):
  """A step of an exact-mode, one-step-off multi-turn run with carried rows (every chart of the
  layout), as the trainer logs."""
  metrics = {
    "reward/mean": 0.4 + 0.01 * step,
    "reward/std": 0.2,
    "response_length/mean": 270.0,
    "kv/read_fraction": 0.83,
    "kv/predicted_speedup": 1.25,
    "rollout/accepted_per_round": 4.8,
    "rollout/draft_acceptance": 0.98,
    "rollout/draft_alpha_mean": 0.98,
    "rollout/draft_alpha_mean_bin": np.where(COUNT_BIN > 0, 0.98, np.nan),
    "rollout/token_lag_bin": np.where(COUNT_BIN > 0, 0.4, np.nan),
    "rollout/tokens_bin": np.where(COUNT_BIN > 0, COUNT_BIN, np.nan),
    "perf/rollout_wait_s": 1.0,
    "perf/train_step_s": 2.0,
    "perf/step_s": 3.5,
    **{f"env/{k}": 1.0 for k in ("tool_calls", "tool_errors", "tool_timeouts", "bad_calls")},
    **{"env/turns/mean": 2.5, "env/turns/max": 4, "env/observation_share": 0.6},
    "eval/dense/mean@1": 0.5,
    "eval/dense/samples": "a completion",
    **_family("acceptance", 0.9 + tau / 100),
    **_family("acceptance_sampled", 0.99),
    **_family("acceptance_stale", 0.97),
  }
  return {**metrics, **dashboard.chart_metrics(metrics, tau)}


def _config(tau):
  c = default.get_config()
  c.stats.tau, c.rl.off_policy_steps, c.rollout.partial_groups = tau, 1, 2
  c.task.name = "env:pointer_chase"  # the multi-turn charts (a layout test: no config check)
  return c


def _write_run(workdir, c, steps=(1, 2), resume_step=0):
  tau = c.stats.tau
  logger = MetricsLogger(str(workdir), resume_step, first_events=dashboard.summaries(c))
  for step in steps:
    logger.write(step, _metrics(step, tau))
  logger.close()


def tensorboard_over(logdir):
  """(the custom scalars plugin, the hparams backend, the request context) over `logdir`, as
  `tensorboard --logdir` serves them."""
  multiplexer = plugin_event_multiplexer.EventMultiplexer()
  multiplexer.AddRunsFromDirectory(str(logdir))
  multiplexer.Reload()
  tb = base_plugin.TBContext(
    logdir=str(logdir),
    multiplexer=multiplexer,
    data_provider=data_provider.MultiplexerDataProvider(multiplexer, str(logdir)),
    plugin_name_to_instance={},
  )
  tb.plugin_name_to_instance["scalars"] = scalars_plugin.ScalarsPlugin(tb)
  custom = custom_scalars_plugin.CustomScalarsPlugin(tb)
  return custom, backend_context.Context(tb), context.RequestContext()


def served_regexes(custom, ctx) -> list:
  """The tag regexes of the layout the custom scalars plugin serves (a Margin chart's tags as
  exact ones)."""
  layout = json.loads(custom.layout_impl(ctx, ""))  # what the frontend is served
  charts = [chart for category in layout["category"] for chart in category["chart"]]
  named = [
    f"{tag}$"
    for chart in charts
    if "margin" in chart
    for tag in chart["margin"]["series"][0].values()
  ]
  return named + [tag for chart in charts for tag in chart.get("multiline", {}).get("tag", [])]


def _session_groups(hparams, ctx):
  request = api_pb2.ListSessionGroupsRequest(
    allowed_statuses=[api_pb2.STATUS_UNKNOWN], start_index=0, slice_size=100
  )
  return list_session_groups.Handler(ctx, hparams, "", request).run().session_groups


def test_dashboard_opens_on_the_layout_with_a_curve_in_every_tag_it_names(tmp_path):
  c = _config(0.86)
  _write_run(tmp_path / "run", c)
  custom, _, ctx = tensorboard_over(tmp_path)
  layout = json.loads(custom.layout_impl(ctx, ""))
  assert [category["title"] for category in layout["category"]] == list(dashboard.layout(c))
  charts = {chart["title"]: chart for cat in layout["category"] for chart in cat["chart"]}
  assert len(charts) == len(dashboard.CHARTS)
  assert charts["reward/mean with its std band"]["margin"]["series"][0] == {
    "value": "reward/mean",
    "lower": "reward/mean_minus_std",
    "upper": "reward/mean_plus_std",
  }
  for regex in served_regexes(custom, ctx):
    curves = custom.scalars_impl(ctx, "run/tensorboard", regex, "")["tag_to_events"]
    assert curves and all(len(points) == 2 for points in curves.values()), regex
  p5_bins = custom.scalars_impl(ctx, "run/tensorboard", r"acceptance/p5_bin/\d+$", "")
  assert sorted(p5_bins["tag_to_events"]) == [f"acceptance/p5_bin/{b:02d}" for b in range(3, 7)]
  tau = custom.scalars_impl(ctx, "run/tensorboard", r"acceptance/tau$", "")["tag_to_events"]
  assert [point[2] for point in tau["acceptance/tau"]] == pytest.approx([0.86, 0.86])


def test_bins_without_tokens_are_not_written_but_stay_in_the_rows(tmp_path):
  _write_run(tmp_path / "run", _config(0.86))
  custom, _, ctx = tensorboard_over(tmp_path)
  scalars = custom.scalars_impl(ctx, "run/tensorboard", r".*_bin/\d+$", "")["tag_to_events"]
  bins = {int(tag.rsplit("/", 1)[1]) for tag in scalars}
  assert bins == {3, 4, 5, 6}  # count_bin is 0 in bins 0-2: neither it nor any stat is written
  assert "acceptance/count_bin/03" in scalars and "acceptance/count_bin/00" not in scalars
  turns = custom.scalars_impl(ctx, "run/tensorboard", r".*_turn/\d+$", "")["tag_to_events"]
  assert {int(tag.rsplit("/", 1)[1]) for tag in turns} == {0, 1, 2}  # count_turn 0 from turn 3
  rows = (tmp_path / "run" / "metrics.jsonl").read_text()
  assert '"acceptance/count_bin": [0, 0, 0, 840, 3544, 2512, 1717]' in rows  # notebooks read these


def test_sweep_runs_carry_their_hyperparameters_and_summary_metrics(tmp_path):
  """Two runs of a threshold sweep, each with the held-out score experiments/tau_sweep.py has
  experiments/evaluate.py write beside its metrics."""
  sweep = sweep_config.get_config()
  sweep.sweep_dir = str(tmp_path)
  for tau, score in ((0.8, 0.6), (0.9, 0.7)):
    rc = tau_sweep.run_config(sweep, dict(run=f"tau{tau}", schedule="fixed:8"), seed=0)
    rc.stats.tau = tau
    _write_run(rc.workdir, rc)
    with SummaryWriter(tau_sweep.eval_config(sweep, rc).logdir) as writer:  # as evaluate.py does
      writer.add_scalar("eval/mean@1", score, rc.total_steps)
  _, hparams, ctx = tensorboard_over(tmp_path)
  groups = {group.name: group for group in _session_groups(hparams, ctx)}
  assert sorted(groups) == ["tau0.8_seed0/tensorboard", "tau0.9_seed0/tensorboard"]
  taus = {name: group.hparams["stats.tau"].number_value for name, group in groups.items()}
  assert taus == {"tau0.8_seed0/tensorboard": 0.8, "tau0.9_seed0/tensorboard": 0.9}
  run = groups["tau0.9_seed0/tensorboard"]
  assert run.hparams["rollout.schedule"].string_value == "fixed:8"
  assert run.hparams["schedule.kind"].string_value == "fixed"
  metrics = {(m.name.group, m.name.tag): m.value for m in run.metric_values}
  assert metrics[("", "reward/mean")] == pytest.approx(0.42)  # the last step's
  assert metrics[("eval", "eval/mean_1")] == pytest.approx(0.7)
  assert set(metrics) == set(dashboard.SUMMARY_METRICS)


def test_a_resumed_run_keeps_one_layout_and_one_session(tmp_path):
  """The dashboard and hyperparameters go with the run's first events only."""
  _write_run(tmp_path / "run", _config(0.86))
  _write_run(tmp_path / "run", _config(0.86), steps=(2, 3), resume_step=1)
  _, hparams, ctx = tensorboard_over(tmp_path)
  multiplexer = hparams.tb_context.multiplexer
  for tag in ("custom_scalars__config__", "_hparams_/session_start_info"):
    assert len(multiplexer.Tensors("run/tensorboard", tag)) == 1, tag
  (group,) = _session_groups(hparams, ctx)
  assert len(group.sessions) == 1


def test_schedule_kind_names_each_spec_form():
  kinds = [
    dashboard.schedule_kind(True, spec)
    for spec in ("fixed:8", "paper:qwen3-1.7b:0.86", "adaptive:0.86:t.json", "0:fixed:8", "t.json")
  ]
  assert kinds == ["fixed", "paper", "adaptive", "stages", "table"]
  assert dashboard.schedule_kind(False, "fixed:8") == "dense"


def test_the_layout_holds_the_charts_a_run_logs():
  c = default.get_config()
  c.rollout.speculate, c.rollout.sparse = 0, False
  assert list(dashboard.layout(c)) == ["tail statistics", "cost", "time per step"]
  assert "predicted rollout speedup" not in dashboard.layout(c)["cost"]
  rows = [_metrics(1, 0.86)]
  assert_dashboard_has_data(_config(0.86), rows)
  del rows[0]["acceptance/p10_bin"]
  with pytest.raises(AssertionError, match=r"acceptance/p10_bin"):
    assert_dashboard_has_data(_config(0.86), rows)
