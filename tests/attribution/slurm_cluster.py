"""A real one-node Slurm for tests: munged, slurmctld and slurmd on 127.0.0.1, in a folder of their own.

Debian's ``slurm-wlm`` and ``munge`` (``make tools`` installs them as root). Own ports, own munge socket and key,
``ProctrackType=proctrack/linuxproc``, ``TaskPlugin=task/none``, ``select/cons_tres`` and ``gpu`` GRES on
character devices made with ``mknod DIR/nvidiaK c 195 K`` (the numbers of ``/dev/nvidiaK``), listed in a gres.conf
with ``AutoDetect=off``. Every daemon runs in the foreground as our child and is stopped by its PID.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "scontrol", "scancel", "sinfo")


def need_slurm() -> None:
    """Skip (fail under CI=true) where a real Slurm cannot run: not root, or the binaries missing."""
    why = None
    if os.geteuid() != 0:
        why = "a real Slurm needs root (slurmd runs jobs as their user)"
    else:
        missing = [d for d in DAEMONS if shutil.which(d) is None]
        if missing:
            why = f"{', '.join(missing)} not installed: run `make tools` as root (Debian's slurm-wlm and munge)"
    if why is not None:
        if os.environ.get("CI") == "true":
            pytest.fail(why)
        pytest.skip(why)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class SlurmCluster:
    """One node named as this host (short name) with ``gpus`` GPUs in GRES.

    Args:
        gpus: how many ``gpu`` GRES the node has (device files ``nvidia0``.. ``nvidia<gpus-1>``).
    """

    def __init__(self, gpus: int) -> None:
        self.gpus = gpus
        self.dir = Path(tempfile.mkdtemp(prefix="slurm-", dir="/tmp"))  # the munge socket path must stay short
        self.node = socket.gethostname().split(".", 1)[0]
        self.conf = self.dir / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self._write()

    def _write(self) -> None:
        d = self.dir
        for sub in ("dev", "state", "spool", "log", "out"):
            (d / sub).mkdir()
        for k in range(self.gpus):
            subprocess.run(["mknod", str(d / "dev" / f"nvidia{k}"), "c", "195", str(k)], check=True)
        key = d / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        ctld, slurmd = _free_port(), _free_port()
        self.conf.write_text(
            f"""ClusterName=smiq{os.getpid()}
SlurmctldHost={self.node}(127.0.0.1)
SlurmctldPort={ctld}
SlurmdPort={slurmd}
AuthType=auth/munge
AuthInfo=socket={d}/munge.sock
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd.pid
SlurmctldLogFile={d}/log/slurmctld.log
SlurmdLogFile={d}/log/slurmd.log
SlurmdParameters=config_overrides
MessageTimeout=5
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
GresTypes=gpu
ReturnToService=2
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
NodeName={self.node} NodeAddr=127.0.0.1 CPUs=16 RealMemory=1000 Gres=gpu:{self.gpus} State=UNKNOWN
PartitionName=gpus Nodes={self.node} Default=YES MaxTime=INFINITE State=UP
""",
            encoding="utf-8",
        )
        (d / "gres.conf").write_text(
            f"AutoDetect=off\nNodeName={self.node} Name=gpu File={d}/dev/nvidia[0-{self.gpus - 1}]\n", encoding="utf-8"
        )

    def _start(self, name: str, argv: list[str]) -> None:
        log = (self.dir / "log" / f"{name}.out").open("ab")
        self.procs[name] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=self.env)
        log.close()

    def start(self) -> SlurmCluster:
        """Start munged, slurmctld and slurmd; wait (60 s at most) until the node is idle."""
        d = self.dir
        self._start(
            "munged",
            [
                "munged",
                "-F",
                "--force",
                f"--socket={d}/munge.sock",
                f"--key-file={d}/munge.key",
                f"--pid-file={d}/munged.pid",
                f"--log-file={d}/log/munged.log",
                f"--seed-file={d}/munged.seed",
            ],
        )
        self._wait(lambda: (d / "munge.sock").exists(), "munged's socket")
        self.start_controller(clean=True)
        self._start("slurmd", ["slurmd", "-D"])
        self._wait(lambda: self.run("sinfo", "-h", "-n", self.node, "-o", "%t").strip() == "idle", "an idle node")
        return self

    def start_controller(self, clean: bool = False) -> None:
        """Start slurmctld (``clean``: without the saved state)."""
        self._start("slurmctld", ["slurmctld", "-D", *(["-i"] if clean else [])])

    def stop_controller(self) -> None:
        """Stop slurmctld by its PID and reap it."""
        self._stop("slurmctld")

    def _stop(self, name: str) -> None:
        proc = self.procs.pop(name, None)
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)

    def _wait(self, ok: object, what: str, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if ok():  # type: ignore[operator]
                return
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise AssertionError(f"{name} exited with {proc.returncode}: {self.logs()}")
            time.sleep(0.2)
        raise AssertionError(f"no {what} within {timeout:g} s: {self.logs()}")

    def logs(self) -> str:
        """The daemons' logs, last lines."""
        out = []
        for f in sorted((self.dir / "log").iterdir()):
            out.append(f"--- {f.name}\n" + "\n".join(f.read_text(errors="replace").splitlines()[-15:]))
        return "\n".join(out)

    def run(self, *argv: str) -> str:
        """A Slurm client command against this cluster: its stdout ('' when it failed)."""
        done = subprocess.run(list(argv), env=self.env, capture_output=True, text=True, timeout=60)
        return done.stdout if done.returncode == 0 else ""

    def submit(self, gres: str, name: str = "smiq-test", seconds: int = 600) -> str:
        """``sbatch --gres=GRES --wrap 'sleep N'``; returns the job id once it runs (within 60 s)."""
        done = subprocess.run(
            ["sbatch", "--parsable", f"--gres={gres}", "-J", name, "-o", "/dev/null", "--wrap", f"sleep {seconds}"],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=60,
            cwd=self.dir / "out",
        )
        assert done.returncode == 0, done.stderr
        job = done.stdout.strip().split(";")[0]
        self._wait(lambda: self.run("squeue", "-h", "-j", job, "-o", "%t").strip() == "R", f"job {job} running")
        return job

    def cancel(self, job: str) -> None:
        """``scancel JOB``."""
        subprocess.run(["scancel", job], env=self.env, check=True, timeout=60)

    def stop(self) -> None:
        """Cancel what runs, stop every daemon by PID, remove the folder."""
        if "slurmctld" in self.procs:
            subprocess.run(["scancel", "-u", "root"], env=self.env, capture_output=True, timeout=60)
            deadline = time.monotonic() + 30  # the jobs' slurmstepd end them; then nothing of ours is left running
            while time.monotonic() < deadline and self.run("squeue", "-h", "-o", "%i").strip():
                time.sleep(0.2)
        for name in ("slurmd", "slurmctld", "munged"):
            self._stop(name)
        shutil.rmtree(self.dir, ignore_errors=True)
