"""The pointer-chasing task: determinism, checker, tokenizer, lengths, and the shipped model."""

import json
import os

import numpy as np
import pytest

import sparrow_jax as sj
from sparrow_jax.data import synthetic
from sparrow_jax.data.tokenizer import load_tokenizer

ASSET_DIR = os.path.join(os.path.dirname(__file__), "..", "assets", "pointer_chase_tiny")


def test_sample_is_deterministic_and_positional():
  task = synthetic.PointerChase(min_hops=4, max_hops=40)
  a, b = task.sample(5, 10), task.sample(5, 10)
  assert [p.prompt for p in a] == [p.prompt for p in b]
  assert task.sample(2, 12)[0] == a[2]
  assert task.sample(1, 11)[0].prompt != a[0].prompt
  other_seed = synthetic.PointerChase(min_hops=4, max_hops=40, seed=1)
  assert other_seed.sample(1, 10)[0].prompt != a[0].prompt
  gen = [task.sample(3, np.random.default_rng(7)) for _ in range(2)]
  assert gen[0] == gen[1]


def test_reference_scores_one_and_chain_is_consistent():
  task = synthetic.PointerChase(min_hops=3, max_hops=30)
  problems = task.sample(20, 0)
  for p in problems:
    assert p.table[p.chain[-1]] == "end" and p.answer == p.chain[-1]
    assert all(p.table[a] == b for a, b in zip(p.chain, p.chain[1:]))
    assert sum(v == "end" for v in p.table.values()) == 2  # real + distractor chain
  refs = [p.reference for p in problems]
  np.testing.assert_array_equal(task.reward(refs, problems), 1.0)
  np.testing.assert_array_equal(task.accuracy(refs, problems), 1.0)
  ids = [list(p.reference_ids) + [task.pad_id] * 3 for p in problems]  # padded rollout rows
  np.testing.assert_array_equal(task.reward(ids, problems), 1.0)


def test_corrupted_solution_gets_partial_credit():
  task = synthetic.PointerChase(min_hops=10, max_hops=10)
  (p,) = task.sample(1, 3)
  words = p.reference.split()
  wrong = next(s for s in (synthetic.symbol(i) for i in range(200)) if s not in p.table)
  words[1] = wrong  # first lookup wrong; the next hop then starts from `wrong` (no entry)
  score = task.reward([" ".join(words)], [p])[0]
  assert score == pytest.approx(9 / 11)  # 11 lookups (10 hops + end), two of them broken
  truncated = " ".join(p.reference.split()[: 3 * 5])
  assert task.reward([truncated], [p])[0] == pytest.approx(5 / 11)
  assert task.accuracy([truncated], [p])[0] == 0.0
  bad_answer = p.reference.rsplit(" ", 1)[0] + " " + wrong
  assert task.reward([bad_answer], [p])[0] == 1.0 and task.accuracy([bad_answer], [p])[0] == 0.0
  # A slip back to an earlier key re-walks entries already followed: no credit for them.
  hops = [f"{a} {p.table[a]} ;" for a in p.chain[:6]]
  looped = " ".join(hops + [f"{p.chain[6]} {p.chain[2]} ;"] + hops[2:] * 3)
  assert task.reward([looped], [p])[0] == pytest.approx(6 / 11)
  # Nor for walking the distractor chain, although each of its lookups matches the table.
  distractor = next(a for a in p.table if a not in p.chain and a not in p.table.values())
  walk, a = [], distractor
  while a != "end":
    walk.append(f"{a} {p.table[a]} ;")
    a = p.table[a]
  detour = " ".join(hops[:2] + [f"{p.chain[2]} {distractor} ;"] + walk)
  assert task.reward([detour], [p])[0] == pytest.approx(2 / 11)
  grades = task.grade([p.reference, truncated, "answer"], [p] * 3)
  assert [g.reason for g in grades] == ["correct", "partial", "wrong"]
  with pytest.raises(ValueError, match="pair up"):
    task.reward([p.reference], [p, p])


def test_tokenizer_round_trip_and_specials():
  task = synthetic.PointerChase(min_hops=5, max_hops=20)
  (p,) = task.sample(1, 0)
  assert task.decode(task.encode(p.prompt)) == p.prompt
  assert list(p.prompt_ids) == task.encode(p.prompt)
  tok = synthetic.build_tokenizer()
  assert [tok.token_to_id(t) for t in synthetic.SPECIAL_TOKENS] == [0, 1, 2]
  assert task.eos_id == tok.token_to_id("<|im_end|>") and p.reference_ids[-1] == task.eos_id
  assert max(p.prompt_ids) < len(synthetic.vocab()) == tok.get_vocab_size()


def test_lengths_as_configured():
  task = synthetic.PointerChase()  # the evaluation setting
  for p in task.sample(10, 0):
    assert p.num_steps == 129 and len(p.reference_ids) == 3 * 129 + 3
    assert 3 * 133 + 7 <= len(p.prompt_ids) <= task.max_prompt_len
    assert len(p.prompt_ids) + len(p.reference_ids) >= 640
  short = synthetic.PointerChase(min_hops=1, max_hops=8)
  assert all(2 <= p.num_steps <= 9 for p in short.sample(30, 0))
  with pytest.raises(ValueError, match="min_hops"):
    synthetic.PointerChase(min_hops=9, max_hops=8)
  with pytest.raises(ValueError, match="symbols"):
    synthetic.PointerChase(max_hops=190)


def test_shipped_model_loads_and_retrieves_far_back():
  cfg, params = sj.load_hf(ASSET_DIR)
  assert cfg.vocab_size == len(synthetic.vocab())
  with open(os.path.join(ASSET_DIR, "generation_config.json")) as f:
    assert json.load(f)["eos_token_id"] == [synthetic.SPECIAL_TOKENS.index("<|im_end|>")]
  tok = load_tokenizer(ASSET_DIR)
  assert tok.eos_ids == (2,) and tok.pad_id == 0
  task = synthetic.PointerChase(seed=10_000)  # the evaluation length: 128 hops, ~880 tokens
  (p,) = task.sample(1, 0)
  seq = np.array([list(p.prompt_ids) + list(p.reference_ids)])
  pred = np.asarray(sj.forward(params, seq, cfg))[0, len(p.prompt_ids) - 1 : -1].argmax(-1)
  # Teacher-forced, the value of hop i is at response offset 3 i + 1: a lookup into the table, up to
  # ~800 tokens back. A trained model gets nearly all of them; an untrained one ~1 / 200.
  lookups = 3 * np.arange(p.num_steps) + 1
  assert np.mean(pred[lookups] == seq[0, len(p.prompt_ids) + lookups]) > 0.9
