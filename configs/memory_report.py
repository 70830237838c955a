"""experiments/memory_report.py: compile-time memory of the train step, the sampler and calibration
at the paper's scale (nothing is allocated), and one real calibration run at length on this CPU.

  python experiments/memory_report.py --config=configs/memory_report.py \\
      [--config.models=qwen3-1.7b --config.lengths=8192,32768 --config.parts=train]
"""

import ml_collections


def get_config():
  c = ml_collections.ConfigDict()
  c.models = "qwen3-1.7b,qwen3-4b,qwen3-8b,qwen3-14b"  # presets, compiled at full width and depth
  c.lengths = "8192,16384,32768,38912"  # tokens per row (prompt + response); 38912 = 1K + 37K
  c.prompt_len = 1024  # prompt tokens of each row
  c.schedule = "paper:{model}:0.86"  # KV schedule ({model}: each model's own); its largest budget
  #                                    sizes the sampler's page buffers (the table itself is traced)
  c.dtype = "bfloat16"  # params and KV cache dtype
  c.layers = 0  # 0: each model's full depth; N: its first N layers (the
  #                                    sampler, calibrate and engine parts; a quick check)
  c.parts = "train,sampler,calibrate,engine,compile_time,calibrate_run"  # what to measure (script;
  #                                    also "layout": the trainer's and a rollout device's memory)
  c.train_rows = 2  # rows per train step: one GRPO group of 2 ...
  c.micro_batches = 2  # ... one row per backward pass (gradient accumulation)
  c.train_minibatches = 1  # updates a step (rl.num_minibatches; > 1 adds a no-grad dense pass)
  c.distill = True  # the train step with DistillSparse (the paper configs: False)
  c.off_policy_steps = 0  # 1: one step off, the state keeps the behaviour params (rl.)
  c.length_buckets = ""  # train also with rl.length_buckets, e.g. "4096,8192,16384" ("" = off)
  c.sampler_rows = 8  # sampled rows ...
  c.sampler_group = 8  # ... in groups of this many samples of one prompt (one prefill)
  c.mesh = "1,1,1"  # data,fsdp,tensor: figures per device (fake CPU devices:
  #                                    XLA_FLAGS=--xla_force_host_platform_device_count=N)
  c.rollout_devices = 0  # layout: the first n devices only roll out, the mesh is over
  #                                    the rest (mesh.rollout_devices); 0 = colocated
  c.layouts = ""  # layout: several in one run, "/" between "n:data,fsdp,tensor:micro_batches:
  #                                    off_policy_steps" (each overrides rollout_devices, mesh,
  #                                    micro_batches, off_policy_steps; "" = those four's one)
  c.target = "cpu"  # cpu: this machine's backend | a TPU topology such as
  #                                    "v5p:4x4x2" (at least the mesh's chips): compile-only TPU
  #                                    devices, parts train, sampler and layout (needs jax[tpu])
  c.calibrate_rows = 1  # rows per calibration pass (one candidate per pass)
  c.engine_pool_gb = 100.0  # the engine's KV pool per device (an H200's 141 GB less
  #                                    weights and working memory)
  c.engine_fallback_pools = "40,30,20"  # layout: if the engine's pool does not fit a device,
  #                                    these pools (GB) in turn until one does
  c.engine_slots = 64  # the engine's slots per device
  c.engine_chunk = 16  # decode steps per compiled chunk
  c.engine_mean_len_frac = 0.5  # mean response length / cutoff for the rows in flight
  c.compile_time_model = "qwen3-1.7b"  # compile time of the train step at full depth ...
  c.compile_time_layers = 4  # ... against this many layers (same widths)
  c.compile_time_len = 8192  # ... at this row length
  c.run_model = "qwen3-0.6b"  # calibrate_run: a real p5 pass of this shape (random weights)
  c.run_len = 16384  # ... over one row this long (prompt_len of it prompt)
  c.out = ""  # also write the figures here, a results record (JSON with
  #                                    the command, commit, machine and date); "" = print only
  return c
