"""experiments/price_async.py: the paper's 1.7B workload (configs/qwen3_1p7b_polaris.py) priced on
the roofline, on-policy on all devices against one step off on rollout devices of their own.

  python experiments/price_async.py --config=configs/price_async.py \\
      [--config.out=docs/results/async_pricing.json]
"""

import ml_collections


def get_config():
  c = ml_collections.ConfigDict()
  c.model = "qwen3-1.7b"  # the paper config's model
  c.tau = 0.86  # sparse rollouts: the published table at this threshold
  c.prompt_len = 1024  # rollout.max_prompt_len of the paper config
  c.gen_len = 37 * 1024  # rollout.max_new_tokens: the paper's math cutoff
  c.mean_len_frac = 0.5  # mean response / cutoff, geometric lengths cut at the cutoff:
  #                                    the value configs/cost_report.py states and the paper
  #                                    config sizes its pool for (the paper reports none)
  c.prompts_per_step = 32  # rollout.prompts_per_step ...
  c.group_size = 8  # ... x n samples = 256 rows a step
  c.devices = 8  # GPUs of the node (the paper config's mesh 1 x 8 x 1)
  c.rollout_devices = (1, 2, 3, 4, 5, 6, 7)  # the splits swept (mesh.rollout_devices)
  c.num_minibatches = 4  # rl.num_minibatches: > 1 adds a no-grad dense pass before them
  c.micro_batches = 8  # rl.micro_batches: a minibatch's rows per backward pass / this
  c.exact_acceptance = True  # stats.exact_acceptance: sparse rollouts add a no-grad sparse pass
  c.hardware = "h200"  # cost_model.HARDWARE entry: peak FLOP/s and HBM bandwidth
  c.link_gbs = 450.0  # GB/s a GPU sends and receives each way: NVLink 4 on H100 / H200
  #                                    SXM (900 GB/s both ways together, the datasheets)
  c.hbm_gb = 141.0  # memory per GPU (H200), against which the rollout's peak is flagged
  # The derated scenario (the roofline one runs everything at peak): the share of its roofline
  # rate a rollout reaches and the model FLOP utilisation of the update.
  c.decode_share_dense = 0.22  # the paper's one absolute dense rate over the roofline's
  #                                    (docs/results/cost_model.md, absolute rate)
  c.decode_share_sparse = 0.16  # the same for its sparse rate
  c.train_mfu = 0.4  # a stated round value for long-row FSDP training, not measured
  c.out = ""  # also write the figures here, a results record (JSON with
  #                                    the command, commit, machine and date); "" = print only
  return c
