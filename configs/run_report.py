"""experiments/run_report.py: the figures of finished trainer runs (and of policy evaluations) as a
results record, which docs/make_results_pages.py renders.

  python experiments/run_report.py --config=configs/run_report.py \\
      --config.runs=default=/tmp/runs/default --config.evals=start=/tmp/runs/eval_start.json \\
      --config.out=docs/results/embedded_default_run.json
"""

import ml_collections


def get_config():
  c = ml_collections.ConfigDict()
  c.runs = ""  # name=workdir,...: finished trainer workdirs (summary.json at their last step)
  c.evals = ""  # name=path,...: experiments/evaluate.py outputs of policies outside the runs
  c.window = 10  # steps averaged at the start and at the end of each run
  c.tau = 0.86  # the threshold the steps-under-tau shares count against
  c.out = ""  # the results record (JSON with the command, commit, machine and date)
  return c
