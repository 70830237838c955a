"""experiments/bench_tunix.py: dense decode tokens/s of a tiny Qwen3 in our sampler and in
google-tunix's.

  python experiments/bench_tunix.py --config=configs/bench_tunix.py \\
      --config.tunix.python=VENV/bin/python [--config.out=docs/results/decode_rollout.json]
"""

import ml_collections


def get_config():
  c = ml_collections.ConfigDict()
  c.batch = 4  # sequences decoded together
  c.runs = 5  # timed calls per sampler and length (median), after one warm-up call
  c.out = ""  # also write the figures here, one results record (JSON with the command, commit,
  # machine and date), when tunix ran; "" = print only

  # The comparison's settings sit under `tunix`, where the results records' config holds them.
  c.tunix = ml_collections.ConfigDict()
  c.tunix.prompt = 64  # prompt tokens
  c.tunix.gen = (32, 160)  # the two generation lengths whose time difference is decode
  # google-tunix is not a project dependency. "" = run in this Python if it imports tunix, else
  # print how to make a venv for it; a path (VENV/bin/python) = rerun the script under that
  # interpreter.
  c.tunix.python = ""
  return c
