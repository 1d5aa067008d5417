"""``python tests/ranks.py NPROC PORT SCRIPT ARGS...``: NPROC ranks of SCRIPT on this machine,
each with the environment torchrun gives a rank (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``ROLE_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``; rank 0
hosts the store on PORT), without torchrun's elastic agent.

The agent imports torch (about 1.5 s of CPU per job on the 2-core test machine) and polls its
ranks; this launcher imports nothing but the standard library. tests/launch.py starts every
multi-rank job with it unless the test asks for torchrun (``rendezvous="direct"``, the
default): those jobs are many, and what they check is the ranks' own work. A test of the
launcher contract itself (torchrun's rendezvous, restarts, a killed agent, the CLI's exit codes
through torchrun) starts torchrun.

The job ends as torchrun's does: when a rank fails, the others get SIGTERM (SIGKILL 5 s later),
each rank that failed on its own (not the ranks stopped after it) is named in a summary line
``exitcode : N`` on stderr (what ``launch.Result.exit_code`` reads), and the job exits 1; 0
when every rank exits 0. The ranks
stay in this process's session, so killing its process group kills the whole job.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

POLL_S = 0.05
GRACE_S = 5.0


def rank_env(rank: int, nproc: int, port: str) -> dict[str, str]:
    return dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc),
                LOCAL_WORLD_SIZE=str(nproc), GROUP_RANK="0", ROLE_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                MASTER_PORT=port)


def run(nproc: int, port: str, script: str, args: list[str]) -> int:
    ranks = [subprocess.Popen([sys.executable, script, *args], env=rank_env(rank, nproc, port))
             for rank in range(nproc)]
    while True:
        codes = [proc.poll() for proc in ranks]
        if any(code not in (None, 0) for code in codes) or all(code == 0 for code in codes):
            break
        time.sleep(POLL_S)
    failed = {rank: code for rank, code in enumerate(codes) if code not in (None, 0)}
    if not failed:
        return 0
    for proc in ranks:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + GRACE_S
    for proc in ranks:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    for rank, code in failed.items():
        print(f"[tests/ranks.py] rank {rank} failed: exitcode : {code}", file=sys.stderr, flush=True)
    return 1


if __name__ == "__main__":
    nproc, port, script, *rest = sys.argv[1:]
    sys.exit(run(int(nproc), port, script, rest))
