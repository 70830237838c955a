"""What TensorBoard opens on for a run: a dashboard in its Custom Scalars tab of the curves a
Sparrow run is read by (reward, the acceptance tail against tau and per position bin, the KV read,
exact mode, staleness, the step's time), and the run's hyperparameters with its summary metrics in
the HParams tab, so the runs of a sweep line up in one table. MetricsLogger writes both with a
run's first events (docs/metrics.md#the-dashboard).

The layout is one table, CHARTS; each chart is shown in the runs that log its tags.
"""

import re

import ml_collections
from tensorboardX import summary
from tensorboardX.proto import api_pb2, plugin_hparams_pb2
from tensorboardX.proto.summary_pb2 import Summary, SummaryMetadata

EVERY_RUN = lambda c: True
SPARSE = lambda c: bool(c.rollout.sparse)
EXACT_MODE = lambda c: bool(c.rollout.speculate)
ONE_STEP_OFF = lambda c: bool(c.rl.off_policy_steps)
CARRIED_ROWS = lambda c: bool(c.rollout.partial_groups)
MULTI_TURN = lambda c: c.task.name.startswith("env:")

# (category, title, kind, tags, the runs that log them). A "Multiline" chart's tags are regular
# expressions, which TensorBoard matches from a tag's start; a "Margin" chart's are a value, its
# lower and its upper bound, exact tags.
CHARTS = (
  (
    "tail statistics",
    "reward/mean with its std band",
    "Margin",
    ("reward/mean", "reward/mean_minus_std", "reward/mean_plus_std"),
    EVERY_RUN,
  ),
  ("tail statistics", "exact p5 against tau", "Multiline", (r"acceptance/(p5|tau)$",), EVERY_RUN),
  ("tail statistics", "exact p5 per bin", "Multiline", (r"acceptance/p5_bin/\d+$",), EVERY_RUN),
  ("tail statistics", "exact mean per bin", "Multiline", (r"acceptance/mean_bin/\d+$",), EVERY_RUN),
  ("tail statistics", "exact p10 per bin", "Multiline", (r"acceptance/p10_bin/\d+$",), EVERY_RUN),
  ("tail statistics", "exact p1 per bin", "Multiline", (r"acceptance/p1_bin/\d+$",), EVERY_RUN),
  (
    "tail statistics",
    "p5 and mean: sampled estimator against exact",
    "Multiline",
    (r"acceptance/(p5|mean)$", r"acceptance_sampled/(p5|mean)$"),
    EVERY_RUN,
  ),
  ("cost", "KV read fraction", "Multiline", (r"kv/read_fraction$",), EVERY_RUN),
  ("cost", "predicted rollout speedup", "Multiline", (r"kv/predicted_speedup$",), SPARSE),
  (
    "exact mode",
    "draft acceptance per bin",
    "Multiline",
    (r"rollout/draft_alpha_mean_bin/\d+$",),
    EXACT_MODE,
  ),
  ("exact mode", "tokens per round", "Multiline", (r"rollout/accepted_per_round$",), EXACT_MODE),
  (
    "one step off",
    "alpha: staleness beside sparsity",
    "Multiline",
    (r"acceptance_stale/(p5|mean)$", r"acceptance/(p5|mean)$"),
    ONE_STEP_OFF,
  ),
  (
    "carried rows",
    "token lag per bin (steps)",
    "Multiline",
    (r"rollout/token_lag_bin/\d+$",),
    CARRIED_ROWS,
  ),
  (
    "carried rows",
    "trained tokens per bin",
    "Multiline",
    (r"rollout/tokens_bin/\d+$",),
    CARRIED_ROWS,
  ),
  (
    "multi-turn",
    "tool calls, errors, timeouts and bad calls per step",
    "Multiline",
    (r"env/tool_calls$", r"env/tool_errors$", r"env/tool_timeouts$", r"env/bad_calls$"),
    MULTI_TURN,
  ),
  ("multi-turn", "model turns per row", "Multiline", (r"env/turns/(mean|max)$",), MULTI_TURN),
  ("multi-turn", "exact p5 per turn", "Multiline", (r"acceptance/p5_turn/\d+$",), MULTI_TURN),
  ("multi-turn", "exact mean per turn", "Multiline", (r"acceptance/mean_turn/\d+$",), MULTI_TURN),
  (
    "multi-turn",
    "observations' share of the completion tokens",
    "Multiline",
    (r"env/observation_share$",),
    MULTI_TURN,
  ),
  (
    "time per step",
    "waiting for rollouts, train step, whole step (s)",
    "Multiline",
    (r"perf/rollout_wait_s$", r"perf/train_step_s$", r"perf/step_s$"),
    EVERY_RUN,
  ),
)

# (run, tag) of the scalars runs are compared by in the HParams tab (each run's last value): run ""
# is the run's own events, "eval" those experiments/evaluate.py writes of its export (tau_sweep.py
# writes them there). TensorBoard's tags have "_" for "@".
SUMMARY_METRICS = (
  ("", "reward/mean"),
  ("", "acceptance/p5"),
  ("", "kv/read_fraction"),
  ("", "eval/dense/mean_1"),
  ("eval", "eval/mean_1"),
)


def layout(c: ml_collections.ConfigDict) -> dict:
  """{category: {title: [kind, tags]}} of the CHARTS run `c` logs (tensorboardX's layout form)."""
  out = {}
  for category, title, kind, tags, logged in CHARTS:
    if logged(c):
      out.setdefault(category, {})[title] = [kind, list(tags)]
  return out


def chart_metrics(metrics: dict, tau: float) -> dict:
  """The tags the dashboard draws beside a step's own metrics: the band reward/mean -+ reward/std,
  and the run's tau (the line its p5 is held above)."""
  mean, std = float(metrics["reward/mean"]), float(metrics["reward/std"])
  return {
    "reward/mean_minus_std": mean - std,
    "reward/mean_plus_std": mean + std,
    "acceptance/tau": tau,
  }


def schedule_kind(sparse: bool, spec: str) -> str:
  """What rollout.schedule names (the forms of sparrow_jax.sparsity.schedule): dense (sparse
  rollouts off), adaptive, stages, fixed, paper or table (a KVSchedule JSON)."""
  if not sparse:
    return "dense"
  if spec.startswith("adaptive:"):
    return "adaptive"
  if re.match(r"^\d+:", spec):
    return "stages"
  return next((kind for kind in ("fixed", "paper") if spec.startswith(f"{kind}:")), "table")


def hparams(c: ml_collections.ConfigDict) -> dict:
  """The settings runs of a sweep differ in, by config field: the spec rollout.schedule names the
  budget (fixed:PAGES, a table's file, adaptive:TAU:BASE)."""
  return {
    "seed": c.seed,
    "stats.tau": c.stats.tau,
    "stats.quantile": c.stats.quantile,
    "schedule.kind": schedule_kind(c.rollout.sparse, c.rollout.schedule),
    "rollout.schedule": c.rollout.schedule,
    "rollout.page_score": c.rollout.page_score,
    "rollout.speculate": str(c.rollout.speculate),  # an int or "auto": one type in every run
    "rl.off_policy_steps": c.rl.off_policy_steps,
    "rollout.partial_groups": c.rollout.partial_groups,
    "rl.mask_alpha_below": c.rl.mask_alpha_below,
    "distill.enabled": bool(c.distill.enabled),
  }


def _hparams_summary(tag: str, **data) -> Summary:
  """A summary of the HParams plugin (tag and content as tensorboard.plugins.hparams reads them)."""
  content = plugin_hparams_pb2.HParamsPluginData(version=0, **data).SerializeToString()
  plugin = SummaryMetadata.PluginData(plugin_name="hparams", content=content)
  return Summary(value=[Summary.Value(tag=tag, metadata=SummaryMetadata(plugin_data=plugin))])


def hparams_summaries(values: dict) -> list:
  """The HParams plugin's experiment (the hyperparameters' names and types, SUMMARY_METRICS) and
  this run's session start (its values). Every run writes the same experiment: TensorBoard reads
  it from any one run of the logdir."""
  start, infos = plugin_hparams_pb2.SessionStartInfo(), []
  for name, value in values.items():
    if isinstance(value, str):
      start.hparams[name].string_value, kind = value, "DATA_TYPE_STRING"
    elif isinstance(value, bool):
      start.hparams[name].bool_value, kind = value, "DATA_TYPE_BOOL"
    elif isinstance(value, (int, float)):
      start.hparams[name].number_value, kind = float(value), "DATA_TYPE_FLOAT64"
    else:
      raise TypeError(f"hyperparameter {name} = {value!r}: expected a str, bool or number")
    infos.append(api_pb2.HParamInfo(name=name, type=api_pb2.DataType.Value(kind)))
  metrics = [
    api_pb2.MetricInfo(name=api_pb2.MetricName(group=g, tag=t)) for g, t in SUMMARY_METRICS
  ]
  experiment = api_pb2.Experiment(hparam_infos=infos, metric_infos=metrics)
  return [
    _hparams_summary("_hparams_/experiment", experiment=experiment),
    _hparams_summary("_hparams_/session_start_info", session_start_info=start),
  ]


def summaries(c: ml_collections.ConfigDict) -> list:
  """What run `c`'s first events carry: its dashboard layout and its hyperparameters."""
  return [summary.custom_scalars(layout(c)), *hparams_summaries(hparams(c))]
