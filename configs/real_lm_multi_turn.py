"""A few multi-turn RL steps on the real LM (SmolLM2-135M-Instruct imported from GGUF), calling a
Python tool: GRPO + TIS on env:python_math over the single-turn run's problems (reasoning-gym's
basic_arithmetic, generated offline; math-verify grades the final \\boxed{} answer), in exact mode:
the sparse policy at configs/real_lm_rl.py's calibrated table drafts, the dense one verifies. Each
row is an episode: a turn may call python(code), which runs in the project's sandbox while the
other rows decode on; its exit status, stdout and stderr come back as the next user turn (context,
out of the loss); a turn without a call is the answer. The prompt lists the tool as Qwen3's
template does (SmolLM2 writes the same ChatML turns and stops at <|im_end|>) and shows one example
call (env.example: without it this model never calls; docs/multi_turn.md). Sized for a few steps
on a 2-core CPU.

  python experiments/import_gguf.py --config=configs/import_gguf.py --config.fetch=True
  python -m sparrow_jax.train --config=configs/real_lm_multi_turn.py
"""

from configs import common, real_lm_rl


def get_config():
  c = real_lm_rl.get_config()  # the model, sparse table, learning rate and bins of the
  #                                    single-turn run; what differs is set below
  c.workdir = "workdir/real_lm_multi_turn"  # checkpoints, TensorBoard events, metrics.jsonl
  c.total_steps = 3  # RL steps: an end-to-end check, not a learning curve
  c.ckpt_every = 3  # one orbax checkpoint, at the end

  c.task = common.task(name="env:python_math")  # an environment: its fields in c.env
  c.env = common.env(
    "env:python_math",
    dataset="math:reasoning_gym:basic_arithmetic",  # the single-turn run's problems
    example=True,  # one example call before the problem (the model copies its format)
    max_turns=3,  # up to two calls, then the answer
    max_observation_tokens=128,  # a program's output or traceback past this is cut
    code_timeout_s=2.0,  # the sandbox's clock for one program
    tool_workers=2,  # programs running at once (2 cores)
  )

  c.rollout.speculate = 4  # exact mode: the sparse policy drafts 4 tokens a round, the dense
  #                                    one verifies, so rows are dense samples. Lossy sparse rows
  #                                    at the table lose the call's JSON shape (docs/multi_turn.md)
  c.rollout.prompts_per_step = 2  # distinct prompts per step
  c.rollout.group_size = 4  # samples per prompt (n): 8 episodes a step
  c.rollout.max_prompt_len = 384  # tool list + example call + the question
  c.rollout.max_new_tokens = 192  # the whole conversation after the prompt, observations included
  c.rl.num_minibatches = 1  # one update of the 8 episodes per step
  c.stats.turns = c.env.get_ref("max_turns")  # the tails per turn (acceptance/*_turn): every turn
  #                                    a row has (env.max_turns, as set on the command line)
  return c
