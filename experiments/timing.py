"""How the benchmark scripts time calls: the settings of a comparison are called in turn, run by
run, so that whatever else loads the machine falls on each of them alike, after one warm-up call
of each (it compiles). Each run starts one setting later than the last, so that no setting always
follows the same one (a call can leave the next one a colder cache or a fragmented heap)."""

import statistics
import time


def interleaved_seconds(calls, runs, warm=()) -> list:
  """Seconds of each of `runs` timed calls of each thunk (a list per thunk), after a warm-up call of
  each not in `warm` (indices of thunks the caller has already called once), the thunks called in
  turn run by run. A thunk runs one call and blocks on its result."""
  for i, call in enumerate(calls):
    if i not in warm:
      call()
  times = [[] for _ in calls]
  for run in range(runs):
    for turn in range(len(calls)):
      i = (turn + run) % len(calls)
      start = time.perf_counter()
      calls[i]()
      times[i].append(time.perf_counter() - start)
  return times


def median_seconds(calls, runs, warm=()) -> list:
  """Median seconds per call of each thunk, timed by `interleaved_seconds`."""
  return [statistics.median(t) for t in interleaved_seconds(calls, runs, warm)]
