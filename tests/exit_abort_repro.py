"""Reproduce the SIGABRT at interpreter exit (issue 34 point 7) on demand; a diagnostic, not a
test (it needs gdb, and takes about 40 s a pair on the 2-core box).

Runs ``test_two_rank_exit.OPEN_AT_EXIT`` (two ranks, caches open, the last step raising
DivergenceError) as ``--pairs`` pairs, each rank under gdb in non-stop mode, where

- a breakpoint on ``c10d::ProcessGroupGloo::AsyncWork::~AsyncWork`` makes the gloo worker
  thread that drops a finished collective sleep ``--pause`` s once the failing step began (the
  other threads run on), as a loaded scheduler would keep it off a core;
- the last exit hook holds the GIL in C for a while (``sum(range(...))``), as the main thread
  of a loaded box would not hand the GIL over before finalizing.

It prints, per rank, the exit and, for an abort, the aborting thread's stack. Seen on this box
before the fix (``--pause 0.8``): 2 aborts in 8 rank runs, both in ``pt_gloo_runloop``:
``runLoop -> ~AsyncAllgatherWork -> TensorImpl::decref_pyobject -> gil_scoped_acquire ->
take_gil -> pthread_exit -> std::terminate``; after it, 0 in 10.

    PYTHONPATH=$PWD python tests/exit_abort_repro.py --pairs 4 --pause 0.8 [--root OLD_TREE]
"""

import argparse
import os
import re
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

PAUSE = r"""
import os, time, gdb
MARKER, PAUSE_S = os.environ["PAUSE_MARKER"], float(os.environ["PAUSE_S"])
class Pause(gdb.Breakpoint):
    def stop(self):
        if os.path.exists(MARKER):
            time.sleep(PAUSE_S)
        return False
gdb.execute("set breakpoint pending on")
Pause("c10d::ProcessGroupGloo::AsyncWork::~AsyncWork")
"""


def script() -> str:
    sys.path[:0] = [ROOT, HERE]
    from test_two_rank_exit import OPEN_AT_EXIT
    s = OPEN_AT_EXIT.replace("faulthandler.enable()\n", "faulthandler.enable()\nimport os\n"
                             "atexit.register(sum, range(150_000_000))\n", 1)
    return s.replace("\nc.step()\n", "\nopen(os.environ['PAUSE_MARKER'], 'w').close()\n"
                     "c.step()\n")


def run_pair(d: str, src: str, gdb_py: str, pause: float, root: str) -> list[str]:
    from hicache.distributed import free_port
    port = str(free_port())
    procs = []
    for r in range(2):
        env = dict(os.environ, PAUSE_MARKER=f"{d}/marker{r}", PAUSE_S=str(pause))
        procs.append(subprocess.Popen(
            ["gdb", "-q", "-batch", "-ex", "set non-stop on", "-ex", "set pagination off",
             "-ex", f"source {gdb_py}", "-ex", "run", "-ex", "thread apply all -s bt 30",
             "--args", sys.executable, src, str(r), port, f"{d}/base", root,
             os.path.join(root, "tests")],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env))
    return [p.communicate(timeout=600)[0] for p in procs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=4)
    ap.add_argument("--pause", type=float, default=0.8)
    ap.add_argument("--root", default=ROOT, help="the hicache tree the ranks import (e.g. a "
                    "checkout from before the fix)")
    args = ap.parse_args()
    d = tempfile.mkdtemp(prefix="exit-abort-")
    src, gdb_py = f"{d}/script.py", f"{d}/pause.py"
    with open(src, "w") as f:
        f.write(script())
    with open(gdb_py, "w") as f:
        f.write(PAUSE)
    aborts = 0
    for i in range(args.pairs):
        for r, out in enumerate(run_pair(f"{d}/pair{i}", src, gdb_py, args.pause, args.root)):
            hit = re.search(r'Thread \d+ "([^"]*)" received signal SIGABRT', out)
            end = re.search(r"exited with code \d+|exited normally", out)
            print(f"pair {i} rank {r}: " + (f"SIGABRT in {hit.group(1)}" if hit else
                                            end.group(0) if end else "?"))
            if hit:
                aborts += 1
                stack = re.search(r"(Thread \d+ \(Thread [^\n]*\(Exiting\)\):\n.*?)\n\n", out,
                                  re.S)
                print(stack.group(1) if stack else out[-3000:])
    print(f"{aborts} aborts in {2 * args.pairs} rank runs")


if __name__ == "__main__":
    main()
