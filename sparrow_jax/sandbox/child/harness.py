"""The harness: the process that, stripped of its privileges, runs the cases one after another and
streams their outcomes."""

import os
import signal

import cases
import privileges
import wire


def run(job, out_fd, info):
  """Gives up its privileges, reports the isolation facts, then runs the cases in turn, streaming
  each outcome, until the last, the first failure (where the job stops at one) or too much output.
  Never returns."""
  privileges.give_up(job, info)
  job["audit_network"] = not info["netns"]
  job["tree"] = "pidns" if info["pidns"] else "uid" if job["uid"] is not None else "case"
  info["cpu_share"] = "cgroup" if job.get("cgroup_stat_fd") is not None else "tree_cpu_budget"
  wire.emit(out_fd, {"isolation": info})
  sent = 0
  for i, case in enumerate(job["cases"]):
    outcome = cases.run_script(job) if job["mode"] == "script" else cases.run_case(job, case)
    sent += sum(len(v) for v in outcome.values() if isinstance(v, str))
    if sent > job["batch_output_bytes"]:  # a flood of output: the rest of the run is not worth it
      wire.emit(
        out_fd,
        {
          "case": i,
          "status": "output_limit",
          "exit": None,
          "time_s": outcome["time_s"],
          "stdout": "",
          "stderr": "",
        },
      )
      break
    wire.emit(out_fd, {"case": i, **outcome})
    if outcome["status"] != "ok" and job["stop_on_failure"]:
      break
    _kill_leftovers(job)
  wire.emit(out_fd, {"done": True})
  os._exit(0)


def _kill_leftovers(job):
  """Ends what a case left running (children in sessions of their own), so that it neither runs
  beside the next case nor counts against its CPU budget: every process this harness may signal,
  which the pid namespace or the sandbox uid confine to the sandbox."""
  if job["tree"] != "case":
    try:
      os.kill(-1, signal.SIGKILL)
    except OSError:  # none left
      pass
