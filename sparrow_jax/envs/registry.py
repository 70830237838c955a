"""Environments by name, as tasks are (sparrow_jax.data.tasks.make_task):

env = make_env("env:pointer_chase", hops=4, decoys=32)   # config fields as keywords
env.config                                              # its frozen, validated config
"""

import dataclasses

from sparrow_jax.envs import pointer_chase, python_math

# name -> (config class, environment class)
ENVS = {
  "env:pointer_chase": (pointer_chase.PointerChaseConfig, pointer_chase.PointerChaseEnv),
  "env:python_math": (python_math.PythonMathConfig, python_math.PythonMathEnv),
}


def env_names() -> list:
  return sorted(ENVS)


def env_config(name: str, **fields):
  """The config of environment `name` from keyword fields; an unknown name or field is refused in
  one line naming it and what is allowed."""
  if name not in ENVS:
    raise ValueError(f"unknown environment {name!r}; known: {env_names()}")
  config_class = ENVS[name][0]
  allowed = [f.name for f in dataclasses.fields(config_class)]
  unknown = sorted(set(fields) - set(allowed))
  if unknown:
    raise ValueError(f"unknown field(s) {unknown} for environment {name}; allowed: {allowed}")
  return config_class(**fields)


def make_env(name: str, **fields):
  """A fresh environment (one per rollout row: it holds that row's episode)."""
  config = env_config(name, **fields)
  return ENVS[name][1](config)
