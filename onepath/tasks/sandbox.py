"""Run untrusted Python in a subprocess with limits, for rewards (tasks/code.py) and agents alike.

`Sandbox.run(code)` writes the code to a fresh temporary directory, starts sandbox_launcher.py there
(namespaces, resource limits, Landlock, an unprivileged uid of the run's own when root), reads at most
`Limits.output_bytes` of stdout and stderr, kills the run at `Limits.wall_s`, and returns a RunResult:
a status, never an exception. What each limit is, how it is enforced as root and not, and what it
does not protect against: docs/sandbox.md.

Every result names the limits the machine could not enforce (`RunResult.unenforced`); the first such
run warns once, and `Sandbox(strict=True)` refuses to run without all of them.
"""
from __future__ import annotations

import itertools
import json
import math
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path

LAUNCHER = Path(__file__).with_name("sandbox_launcher.py")
STATUSES = ("ok", "error", "timeout", "memory", "output_limit", "killed", "crashed", "sandbox_error")
# the limits every run must enforce; RunResult.unenforced names those the machine could not
LIMITS = ("cpu_time", "wall_time", "memory", "processes", "output", "network", "filesystem", "environment",
          "cleanup")
CRASH_SIGNALS = {signal.SIGSEGV, signal.SIGBUS, signal.SIGILL, signal.SIGFPE, signal.SIGABRT, signal.SIGSYS}
# a run's own uid when root: 1e9 + (pid mod 2**20) * 1024 + (run mod 1024), below 2**31 and unique
# among the runs in flight on the machine (a pool never holds 1024 at once)
UID_BASE, UID_RUNS = 1_000_000_000, 1024
INTERPRETERS = ("/usr/bin/python3", "/usr/local/bin/python3")  # besides sys.executable, for the dropped uid
GRACE_S = 1.0  # after the run ends: how long its pipes may take to reach EOF


@dataclass(frozen=True, slots=True)
class Limits:
    cpu_s: int = 2                 # RLIMIT_CPU: SIGXCPU at cpu_s seconds of CPU, SIGKILL one second later
    wall_s: float = 5.0            # the whole run, launcher included; then every process is killed
    memory_mb: int = 256           # RLIMIT_AS of each process
    processes: int = 8             # processes and threads at once, the program itself included
    output_bytes: int = 64 << 10   # of stdout and of stderr each; more kills the run
    disk_mb: int = 16              # the work dir's tmpfs, and RLIMIT_FSIZE
    max_files: int = 256           # inodes of the work dir's tmpfs
    open_files: int = 64           # RLIMIT_NOFILE

    def __post_init__(self):
        for name in ("cpu_s", "memory_mb", "processes", "output_bytes", "disk_mb", "max_files", "open_files"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"sandbox limit {name} = {value!r} must be an integer >= 1")
        if not (isinstance(self.wall_s, (int, float)) and math.isfinite(self.wall_s) and self.wall_s > 0):
            raise ValueError(f"sandbox limit wall_s = {self.wall_s!r} must be a finite number of seconds > 0")


@dataclass(slots=True)
class RunResult:
    status: str                    # one of STATUSES
    exit_code: int | None = None   # the program's exit code, or None when a signal ended it
    signal: int | None = None
    stdout: str = ""
    stderr: str = ""
    truncated: bool = False        # stdout or stderr passed Limits.output_bytes (status output_limit)
    wall_s: float = 0.0
    cpu_s: float | None = None     # user + system CPU of the program and the children it waited for
    detail: str = ""               # why, in a line: which limit, or the sandbox's own failure
    channel: str = ""              # what the program wrote to its extra pipe (Sandbox.run's channel=True)
    uid: int | None = None         # the run's own uid (when the caller is root)
    unenforced: tuple[str, ...] = ()
    enforcement: dict = field(default_factory=dict)  # limit -> how this run enforced it, or None

    @property
    def ok(self) -> bool:
        return self.status == "ok"


class Sandbox:
    """Runs at most `workers` programs at once, from any number of threads (`map` fans out over them)."""

    def __init__(self, limits: Limits = Limits(), workers: int | None = None, strict: bool = False,
                 interpreters: tuple[str, ...] | None = None, landlock: bool = True):
        self.limits = limits
        self.workers = workers or max(2, os.cpu_count() or 1)
        if self.workers < 1:
            raise ValueError(f"sandbox workers = {workers} must be >= 1")
        self.strict = strict
        self.landlock = landlock  # False exercises the read-only-mounts fallback (tests)
        own = [sys.executable, os.path.realpath(sys.executable)]
        self.interpreters = tuple(dict.fromkeys(interpreters or (*own, *INTERPRETERS)))
        self.slots = threading.BoundedSemaphore(self.workers)
        self.runs = itertools.count()
        self.warned = False
        self.probed: RunResult | None = None
        self.lock = threading.Lock()
        self.pool: ThreadPoolExecutor | None = None

    def map(self, fn, items) -> list:
        """[fn(item) for item in items] on `workers` threads; fn runs its programs through this sandbox."""
        items = list(items)
        if len(items) <= 1:
            return [fn(item) for item in items]
        with self.lock:
            if self.pool is None:
                self.pool = ThreadPoolExecutor(self.workers, thread_name_prefix="sandbox")
        return list(self.pool.map(fn, items))

    def probe(self) -> RunResult:
        """One empty run, made once: what this machine enforces (RunResult.enforcement, .unenforced)."""
        with self.lock:
            if self.probed is None:
                self.probed = self._guarded("pass", "", {}, (), self.limits, False)
        return self.probed

    def run(self, code: str, stdin: str = "", files: dict[str, str] | None = None, argv: tuple[str, ...] = (),
            limits: Limits | None = None, channel: bool = False) -> RunResult:
        """Run `code` as main.py (argv after it) with stdin, beside `files` (name -> text). channel: the
        program gets a write-only pipe whose fd number is its last argument; what it writes comes back in
        RunResult.channel (bounded like stdout). A failure of the sandbox itself is a result too."""
        if self.strict and self.probe().unenforced:
            raise RuntimeError(f"{self._unenforced(self.probe())}: Sandbox(strict=True) refuses to run")
        result = self._guarded(code, stdin, files or {}, argv, limits or self.limits, channel)
        if result.unenforced and result.status != "sandbox_error" and not self.warned:
            self.warned = True
            warnings.warn(self._unenforced(result), RuntimeWarning, stacklevel=2)
        return result

    def _guarded(self, *args) -> RunResult:
        with self.slots:
            start = time.monotonic()
            try:
                result = self._run(*args)
            except Exception as e:  # noqa: BLE001 - the caller (a reward, an agent) gets a result, never a crash
                result = RunResult("sandbox_error", detail=f"{type(e).__name__}: {e}")
            result.wall_s = time.monotonic() - start
        return result

    @staticmethod
    def _unenforced(result: RunResult) -> str:
        return (f"sandbox: this machine does not enforce {', '.join(result.unenforced)} "
                f"({describe(result.enforcement)}); docs/sandbox.md says what each needs")

    def _run(self, code, stdin, files, argv, limits: Limits, channel: bool) -> RunResult:
        workdir = tempfile.mkdtemp(prefix="onepath-sandbox-")
        pipes = []
        try:
            for name, text in {"main.py": code, **files}.items():
                if "/" in name or name in ("", ".", ".."):
                    raise ValueError(f"sandbox file name {name!r}: give a plain name, no directories")
                Path(workdir, name).write_text(text)
            Path(workdir, ".stdin").write_text(stdin)
            report_r, report_w = os.pipe()
            pipes += [report_r, report_w]
            pass_fds = [report_w]
            channel_r = None
            if channel:
                channel_r, channel_w = os.pipe()
                pipes += [channel_r, channel_w]
                pass_fds.append(channel_w)
                argv = (*argv, str(channel_w))
            root = os.geteuid() == 0
            run = next(self.runs) % UID_RUNS
            cfg = {"workdir": workdir, "report_fd": report_w, "pass_fds": pass_fds[1:], "argv": ["main.py", *argv],
                   "uid": UID_BASE + (os.getpid() % 2**20) * UID_RUNS + run if root else None,
                   "cpu_s": limits.cpu_s, "memory_bytes": limits.memory_mb << 20,
                   # a non-root run counts the launcher and the init in its user namespace too
                   "processes": limits.processes + (0 if root else 2), "disk_bytes": limits.disk_mb << 20,
                   "max_files": limits.max_files, "open_files": limits.open_files,
                   "interpreters": list(self.interpreters), "landlock": self.landlock, "env": clean_env(workdir)}
            with open(Path(workdir, ".stdin"), "rb") as stdin_file:
                proc = subprocess.Popen(
                    [sys.executable, "-I", "-S", "-B", str(LAUNCHER), json.dumps(cfg)], stdin=stdin_file,
                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, pass_fds=pass_fds, cwd=workdir,
                    env=clean_env(workdir), start_new_session=True)
            for fd in pass_fds:
                os.close(fd)
                pipes.remove(fd)
            try:
                return self._watch(proc, report_r, channel_r, limits, cfg["uid"])
            except BaseException:
                self._kill(proc, cfg["uid"])  # whatever broke here, the run does not outlive it
                proc.wait()
                raise
        finally:
            for fd in pipes:
                os.close(fd)
            shutil.rmtree(workdir, ignore_errors=True)

    def _watch(self, proc: subprocess.Popen, report_r: int, channel_r: int | None, limits: Limits,
               uid: int | None) -> RunResult:
        """Read the pipes (bounded) until the run ends or breaks a limit; kill what is left; the result."""
        out, err = proc.stdout.fileno(), proc.stderr.fileno()
        streams = {out: bytearray(), err: bytearray(), report_r: bytearray()}
        if channel_r is not None:
            streams[channel_r] = bytearray()
        caps = {fd: limits.output_bytes for fd in streams}
        caps[report_r] = 1 << 16
        pidfd = os.pidfd_open(proc.pid)
        selector = selectors.DefaultSelector()
        for fd in streams:
            os.set_blocking(fd, False)
            selector.register(fd, selectors.EVENT_READ)
        selector.register(pidfd, selectors.EVENT_READ)
        deadline, ended, killed_for, truncated = time.monotonic() + limits.wall_s, None, None, False
        try:
            while selector.get_map():
                now = time.monotonic()
                if ended is None and now >= deadline:
                    killed_for = "timeout"
                    ended = self._kill(proc, uid)
                elif ended is not None and now >= ended + GRACE_S:
                    break  # a process we could not kill holds a pipe open: stop reading it
                timeout = (deadline if ended is None else ended + GRACE_S) - now
                for key, _ in selector.select(max(timeout, 0)):
                    fd = key.fd
                    if fd == pidfd:
                        selector.unregister(pidfd)
                        ended = self._kill(proc, uid)  # the run is over: its stragglers go too
                        continue
                    chunk = os.read(fd, 1 << 16)
                    if not chunk:
                        selector.unregister(fd)
                        continue
                    room = caps[fd] - len(streams[fd])
                    streams[fd] += chunk[:max(room, 0)]
                    if len(chunk) > room and ended is None:
                        truncated = fd in (out, err) or truncated
                        killed_for = killed_for or "output_limit"
                        ended = self._kill(proc, uid)
        finally:
            selector.close()
            os.close(pidfd)
        _, wait_status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(wait_status)
        proc.stdout.close()
        proc.stderr.close()
        report = records(streams[report_r])
        text = {fd: bytes(data).decode(errors="replace") for fd, data in streams.items()}
        result = RunResult("ok", stdout=text[out], stderr=text[err],
                           truncated=truncated, channel=text.get(channel_r, ""))
        result.enforcement = enforcement(report.get("ready"), limits)
        result.uid = (report.get("ready") or {}).get("uid")
        result.unenforced = tuple(name for name in LIMITS if result.enforcement.get(name) is None)
        if "error" in report:
            return replace(result, status="sandbox_error", detail=f"the sandbox could not start: {report['error']}")
        if "ready" not in report and killed_for is None:
            return replace(result, status="sandbox_error", detail="the launcher ended without a report: "
                           + (text[err].strip().splitlines() or ["no output"])[-1])
        # with a PID namespace the init reports the program's own status; without one the launcher was the program
        status = report.get("exit", wait_status)
        result.cpu_s = report.get("cpu_s", usage.ru_utime + usage.ru_stime)
        code = os.waitstatus_to_exitcode(status)
        result.exit_code, result.signal = (code, None) if code >= 0 else (None, -code)
        return classify(result, killed_for, limits)

    def _kill(self, proc: subprocess.Popen, uid: int | None) -> float:
        """Kill the run's session and every process of its uid (a PID namespace's teardown would get them
        too, but after the pipes' EOF; the run must be over when it returns); when."""
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if uid is not None:
            kill_uid(uid)
        return time.monotonic()


def records(report: bytes) -> dict:
    """The launcher's report lines, merged (a line cut short by a kill is skipped)."""
    merged = {}
    for line in bytes(report).decode(errors="replace").splitlines():
        try:
            merged.update(json.loads(line))
        except ValueError:
            pass
    return merged


def clean_env(workdir: str) -> dict[str, str]:
    """The program's whole environment: none of the host's variables."""
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8"}


def kill_uid(uid: int, rounds: int = 100) -> int:
    """SIGKILL every live process of uid until a scan finds none (a fork bomb refills between scans, a
    killed one lingers until the signal lands); how many distinct processes it killed."""
    killed = set()
    for _ in range(rounds):
        found = 0
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                if entry.stat().st_uid != uid:
                    continue
                with open(f"/proc/{entry.name}/stat") as f:
                    if f.read().rsplit(")", 1)[1].split()[0] == "Z":  # dead already, waiting for its parent
                        continue
                os.kill(int(entry.name), signal.SIGKILL)
                killed.add(int(entry.name))
                found += 1
            except (FileNotFoundError, ProcessLookupError):
                pass
        if not found:
            break
    return len(killed)


def enforcement(ready: dict | None, limits: Limits) -> dict:
    """limit -> how the run enforced it (None: not enforced), from the launcher's report."""
    if ready is None:
        return {}
    ns = set(ready.get("namespaces", ()))
    uid = ready.get("uid")
    if uid is not None:
        processes = f"RLIMIT_NPROC {limits.processes} on the run's own uid {uid}"
    elif "user" in ns:
        processes = f"RLIMIT_NPROC {limits.processes} in the run's user namespace"
    else:
        processes = None  # RLIMIT_NPROC would count the caller's own processes
    if "pid" in ns:
        cleanup = "PID namespace: its init leaves with the program and the kernel kills the rest"
    elif uid is not None:
        cleanup = f"every process of uid {uid} killed"
    else:
        cleanup = None  # the session is killed, but a process that calls setsid leaves it
    return {
        "cpu_time": f"RLIMIT_CPU {limits.cpu_s} s",
        "wall_time": f"killed after {limits.wall_s} s",
        "memory": f"RLIMIT_AS {limits.memory_mb} MiB per process",
        "processes": processes,
        "output": f"{limits.output_bytes} bytes of stdout and of stderr, then killed",
        "network": "a network namespace of its own, no interface up" if "net" in ns else None,
        "filesystem": ready.get("filesystem") and f"{ready['filesystem']}: writes only in the work dir",
        "environment": "a clean environment",
        "cleanup": cleanup,
        "disk": (f"tmpfs of {limits.disk_mb} MiB" if ready.get("disk") == "tmpfs" else
                 f"RLIMIT_FSIZE {limits.disk_mb} MiB per file"),
        "proc": "/proc of its own PID namespace" if ready.get("proc") else "the host's /proc",
        "interpreter": ready.get("interpreter"),
    }


def classify(result: RunResult, killed_for: str | None, limits: Limits) -> RunResult:
    """The status and its detail, from why the sandbox killed the run, else how the program ended."""
    if killed_for == "timeout":
        return replace(result, status="timeout", detail=f"wall time limit {limits.wall_s} s")
    if killed_for == "output_limit":
        return replace(result, status="output_limit", detail=f"output over {limits.output_bytes} bytes")
    if result.signal is not None:
        # SIGXCPU comes from RLIMIT_CPU alone; its SIGKILL one second later finds the CPU time spent
        if result.signal == signal.SIGXCPU or (result.signal == signal.SIGKILL and (result.cpu_s or 0) >= limits.cpu_s):
            return replace(result, status="timeout", detail=f"CPU time limit {limits.cpu_s} s")
        name = signal.Signals(result.signal).name if result.signal in signal.valid_signals() else str(result.signal)
        status = "crashed" if result.signal in CRASH_SIGNALS else "killed"
        return replace(result, status=status, detail=f"ended by {name}")
    if result.exit_code == 0:
        return result
    last = (result.stderr.strip().splitlines() or [""])[-1]
    if last.startswith("MemoryError"):
        return replace(result, status="memory", detail=f"memory limit {limits.memory_mb} MiB")
    return replace(result, status="error", detail=last[:200] or f"exit code {result.exit_code}")


def describe(enforced: dict) -> str:
    return "; ".join(f"{name}: {how or 'NOT ENFORCED'}" for name, how in enforced.items() if name in LIMITS)
