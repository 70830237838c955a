"""The shipped real-LM mismatch record (docs/results/real_lm_mismatch.json): each bin's pages are
its schedule's at that bin's own cached lengths (the lengths schedule.position_bin puts in it), and
its derived fields are what experiments/real_lm_mismatch.py derives from its stored statistics."""

import json
import os

import numpy as np
import pytest

from sparrow_jax.sparsity.schedule import KVSchedule, position_bin
from tests.helpers import ROOT, load_file

RECORD = os.path.join(ROOT, "docs", "results", "real_lm_mismatch.json")


def _results(path=RECORD):
  with open(path) as f:
    return json.load(f)["results"]


def _bin_lengths(num_bins, page_size, bin_size):
  """The cached lengths of each bin, as position_bin assigns them."""
  lengths = np.arange(num_bins * bin_size)
  bins = np.asarray(position_bin(lengths, page_size, bin_size))
  return [lengths[bins == b] for b in range(num_bins)]


def check_pages_at_own_lengths(r):
  page, bin_size, num_bins = r["page_size"], r["bin_size"], r["num_bins"]
  bins = _bin_lengths(num_bins, page, bin_size)
  for name, t in r["tables"].items():
    sched = KVSchedule.table(t["topk_bin"], page, 3, bin_size)
    for b, lengths in enumerate(bins):
      got, cached = np.asarray(sched.budget_pages(lengths)), -(-lengths // page)
      # one budget over the whole bin, capped at the pages cached: the record's at the last step
      np.testing.assert_array_equal(got, np.minimum(t["pages_bin"][b], cached), f"{name} bin {b}")
      assert t["share_bin"][b] == pytest.approx(t["pages_bin"][b] / cached[-1]), (name, b)
  for model, d in r["paper_tables"].items():
    sched = KVSchedule.paper(model, 0.86)
    for b, lengths in enumerate(bins):
      got = np.asarray(sched.budget_pages(lengths))
      # the paper's 2000-token bins may step up inside one of ours: the bin's last step reads most
      assert d["pages"][b] == got[-1] == got.max(), (model, b, got[0], got[-1])
      assert d["share"][b] == pytest.approx(got[-1] / -(-lengths[-1] // sched.page_size))


def test_record_pages_are_the_schedules_at_each_bins_own_lengths():
  check_pages_at_own_lengths(_results())


def test_record_derived_fields_recompute_from_its_statistics():
  r = _results()
  study = load_file("experiments/real_lm_mismatch.py")
  fields, _ = study.derived(r, study.stored_gen_lengths(r))
  for key, value in fields.items():
    assert r[key] == value, key
  assert sum(r["post_eos_bin"]) <= r["generated_tokens"]
  assert all(0 <= p <= n for p, n in zip(r["post_eos_bin"], r["count_bin"]))
