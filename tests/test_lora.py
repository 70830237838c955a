"""LoRA: a fresh adapter is a no-op; merging folds it into the weights exactly; unmerge undoes
it."""

import jax
import numpy as np
import pytest

import sparrow_jax as sj
from sparrow_jax.model import lora as lora_lib
from tests.helpers import tiny_config

CFG = tiny_config()
PARAMS = sj.init_params(CFG, jax.random.PRNGKey(0), std=0.2)
TOKENS = jax.numpy.asarray(np.random.RandomState(0).randint(0, CFG.vocab_size, (2, 12)))


@pytest.mark.slow
def test_fresh_adapter_is_identity_and_merge_matches():
  lora = lora_lib.init_lora(PARAMS, jax.random.PRNGKey(1), rank=4, alpha=8.0, targets=("q", "down"))
  base = sj.forward(PARAMS, TOKENS, CFG)
  np.testing.assert_allclose(sj.forward(PARAMS, TOKENS, CFG, lora=lora), base, atol=1e-6)
  lora = jax.tree_util.tree_map(lambda x: x + 0.05, lora)
  adapted = sj.forward(PARAMS, TOKENS, CFG, lora=lora)
  assert float(np.abs(adapted - base).max()) > 1e-3
  merged = lora_lib.merge(PARAMS, lora)
  np.testing.assert_allclose(sj.forward(merged, TOKENS, CFG), adapted, atol=1e-5)
  jax.tree_util.tree_map(
    lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6), lora_lib.unmerge(merged, lora), PARAMS
  )


def test_bad_lora_config():
  with pytest.raises(ValueError, match="lora targets"):
    lora_lib.init_lora(PARAMS, jax.random.PRNGKey(0), targets=("lm_head",))
  with pytest.raises(ValueError, match="rank"):
    lora_lib.init_lora(PARAMS, jax.random.PRNGKey(0), rank=0)
