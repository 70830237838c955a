"""Evaluates a policy: mean@k and pass@k on a task, dense or sparse generation. By default the
default run's exported policy (workdir/default/hf) on 128 held-out 128-hop pointer-chasing problems
x 2 dense samples (docs/embedded_default.md); model, task and rollout fields mean what they mean in
the trainer (configs/common.py), so an evaluation sees exactly what training saw.

  python experiments/evaluate.py --config=configs/evaluate.py
  python experiments/evaluate.py --config=configs/evaluate.py \\
      --config.model.hf_dir=assets/pointer_chase_tiny --config.out=eval_base.json  # the start
  python experiments/evaluate.py --config=configs/evaluate.py --config.model.hf_dir=DIR \\
      --config.task.name=math:reasoning_gym:basic_arithmetic --config.num_problems=50 \\
      --config.samples=16 --config.k=1,4,16 --config.rollout.max_new_tokens=4096 \\
      --config.batch_size=16 --config.rollout.sparse=True \\
      --config.rollout.schedule=paper:qwen3-1.7b:0.86 --config.rollout.dense_layers=2
"""

import ml_collections

from configs import common


def get_config():
  c = ml_collections.ConfigDict()
  c.seed = 1234  # task seed (problem order) and sampling key; training used 0
  c.out = "eval.json"  # results JSON (settings, metrics, per-problem counts)
  c.logdir = ""  # TensorBoard dir of eval/<metric> ("" = <out without .json>_tb)
  c.step = 0  # TensorBoard step (e.g. the checkpoint's training step)

  c.model = common.model(hf_dir="workdir/default/hf")  # the default run's final policy
  c.task = common.task()  # registry name + data path, or synthetic pointer chasing
  c.num_problems = 128  # the task's first problems (0 = all of a finite task)
  c.samples = 2  # n, samples per problem
  c.k = "1"  # comma-separated k <= samples for mean@k / pass@k
  c.batch_size = 64  # rows per generate call (one static shape, one compile)

  c.rollout = common.rollout(sparse=False)  # dense by default; sparse under rollout.schedule (one
  #                                           KVSchedule: JSON path, fixed:PAGES or paper:MODEL:TAU)
  return c
