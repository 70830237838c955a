"""How the benchmark scripts time calls: the settings of a comparison are called in turn, run by
run, so that whatever else loads the machine falls on each of them alike, after one warm-up call
of each (it compiles)."""

import statistics
import time


def interleaved_seconds(calls, runs) -> list:
  """Seconds of each of `runs` timed calls of each thunk (a list per thunk), after a warm-up call of
  each, the thunks called in turn run by run. A thunk runs one call and blocks on its result."""
  for call in calls:
    call()
  times = [[] for _ in calls]
  for _ in range(runs):
    for call, t in zip(calls, times):
      start = time.perf_counter()
      call()
      t.append(time.perf_counter() - start)
  return times


def median_seconds(calls, runs) -> list:
  """Median seconds per call of each thunk, timed by `interleaved_seconds`."""
  return [statistics.median(t) for t in interleaved_seconds(calls, runs)]
