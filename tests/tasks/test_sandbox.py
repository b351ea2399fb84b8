"""The sandbox against hostile programs: each ends with a clear status and leaves nothing behind (no
process, no file, no connection); every limit is enforced on this machine (root, as CI), and the
non-root path (a user namespace) and the no-Landlock fallback (read-only mounts) hold too."""
import json
import os
import secrets
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from onepath.tasks.sandbox import LIMITS, STATUSES, Limits, RunResult, Sandbox, kill_uid

REPO = Path(__file__).resolve().parents[2]
FAST = Limits(cpu_s=1, wall_s=3)


@pytest.fixture(scope="module")
def sandbox():
    return Sandbox(FAST, workers=2)


def processes_of(uid: int) -> list[int]:
    """The live processes of uid (a zombie has run its course)."""
    found = []
    for entry in os.scandir("/proc"):
        try:
            if entry.name.isdigit() and entry.stat().st_uid == uid:
                if Path(f"/proc/{entry.name}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                    found.append(int(entry.name))
        except FileNotFoundError:
            pass
    return found


def test_a_plain_run_reports_output_exit_code_and_time(sandbox):
    result = sandbox.run("import sys\nprint(input()[::-1])\nprint('oops', file=sys.stderr)\nsys.exit(3)",
                         stdin="abc\n")
    assert (result.status, result.exit_code, result.signal) == ("error", 3, None)
    assert (result.stdout, result.stderr) == ("cba\n", "oops\n")
    assert 0 < result.wall_s < FAST.wall_s and result.cpu_s > 0 and not result.truncated
    ok = sandbox.run("print('hi')")
    assert (ok.status, ok.exit_code, ok.stdout, ok.ok) == ("ok", 0, "hi\n", True)
    raised = sandbox.run("raise ValueError('boom')")
    assert raised.status == "error" and raised.detail == "ValueError: boom"


def test_every_limit_is_enforced_here_and_says_how(sandbox):
    result = sandbox.run("pass")
    assert result.unenforced == ()
    assert set(LIMITS) <= set(result.enforcement) and all(result.enforcement[name] for name in LIMITS)
    if os.geteuid() == 0:
        assert str(result.uid) in result.enforcement["processes"]
    # and the fields a caller reads are all there
    assert result.status in STATUSES and isinstance(result, RunResult)


def test_an_infinite_loop_hits_the_cpu_limit(sandbox):
    result = sandbox.run("while True:\n    pass")
    assert result.status == "timeout" and result.detail == "CPU time limit 1 s"
    assert result.wall_s < FAST.wall_s


def test_a_sleeper_hits_the_wall_limit(sandbox):
    start = time.monotonic()
    result = sandbox.run("import time\ntime.sleep(60)", limits=Limits(wall_s=1))
    assert result.status == "timeout" and result.detail == "wall time limit 1 s"
    assert time.monotonic() - start < 1 + 2  # killed, not waited for


def test_a_huge_allocation_hits_the_memory_limit(sandbox):
    result = sandbox.run("x = bytearray(10**10)")
    assert result.status == "memory" and result.detail == f"memory limit {FAST.memory_mb} MiB"


def test_a_huge_output_is_cut_and_the_run_killed(sandbox):
    limits = Limits(output_bytes=1000, wall_s=3)
    result = sandbox.run("while True:\n    print('x' * 100)", limits=limits)
    assert result.status == "output_limit" and result.truncated
    assert len(result.stdout) == 1000 and result.wall_s < 2


def test_a_fork_bomb_is_capped_and_nothing_survives(sandbox):
    counted = sandbox.run(
        "import os, time\nn = 0\nwhile True:\n    try:\n        pid = os.fork()\n    except OSError:\n"
        "        break\n    if pid == 0:\n        time.sleep(30)\n        os._exit(0)\n    n += 1\nprint(n)")
    assert counted.status == "ok" and int(counted.stdout) == FAST.processes - 1  # the program is one of them
    bomb = sandbox.run("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass")
    assert bomb.status == "timeout"
    if os.geteuid() == 0:
        assert processes_of(counted.uid) == [] and processes_of(bomb.uid) == []


def test_children_that_outlive_the_program_are_killed(sandbox):
    # the child leaves the session (setsid) and keeps the output pipe: the run still ends at once
    result = sandbox.run("import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(60)\nprint('bye')")
    assert result.status == "ok" and result.stdout == "bye\n" and result.wall_s < 2
    if os.geteuid() == 0:
        assert processes_of(result.uid) == []


def test_writes_outside_the_work_dir_fail_and_inside_work(sandbox):
    outside = [Path("/tmp") / f"onepath-escape-{secrets.token_hex(4)}", REPO / f"escape-{secrets.token_hex(4)}",
               Path("/dev/shm") / f"onepath-escape-{secrets.token_hex(4)}"]
    code = ("import os\nfor path in %r:\n    try:\n        open(path, 'w').write('x')\n        print('wrote', path)\n"
            "    except OSError as e:\n        print('refused', type(e).__name__)\n"
            "open('inside.txt', 'w').write('ok')\nprint(open('inside.txt').read(), os.getcwd() == os.environ['HOME'])"
            % [str(p) for p in outside])
    result = sandbox.run(code)
    assert result.status == "ok", result.stderr
    assert result.stdout.splitlines() == ["refused PermissionError"] * 3 + ["ok True"]
    assert not any(p.exists() for p in outside)


def test_the_hosts_environment_is_not_visible(sandbox, monkeypatch):
    secret = secrets.token_hex(16)
    monkeypatch.setenv("ONEPATH_TEST_SECRET", secret)
    code = ("import os\nprint(dict(os.environ))\nfor pid in [%d, %d]:\n    try:\n"
            "        print(open(f'/proc/{pid}/environ', 'rb').read())\n    except OSError as e:\n"
            "        print('no', pid, type(e).__name__)" % (os.getpid(), os.getppid()))
    result = sandbox.run(code)
    assert result.status == "ok" and secret not in result.stdout + result.stderr
    assert "ONEPATH_TEST_SECRET" not in result.stdout
    assert sorted(eval(result.stdout.splitlines()[0])) == ["HOME", "LANG", "PATH", "TMPDIR"]
    # the negative control: a plain subprocess of the test sees it
    plain = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert secret in plain.stdout


def test_network_connections_fail(sandbox):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.settimeout(0.5)
    port = server.getsockname()[1]
    program = ("import socket\nfor family, addr in ((socket.AF_INET, ('127.0.0.1', %d)), (socket.AF_INET, (%r, %d))):"
               "\n    s = socket.socket(family)\n    s.settimeout(1)\n    try:\n        s.connect(addr)\n        print('connected')"
               "\n    except OSError as e:\n        print('refused', type(e).__name__)")
    code = program % (port, "1.1.1.1", 53)
    try:
        result = sandbox.run(code)
        assert result.status == "ok" and "connected" not in result.stdout, result.stdout
        assert result.stdout.count("refused") == 2
        with pytest.raises(socket.timeout):
            server.accept()
        # the negative control: the same program outside the sandbox connects
        plain = subprocess.run([sys.executable, "-c", program % (port, "127.0.0.1", port)],
                               capture_output=True, text=True, timeout=10)
        assert plain.stdout.count("connected") == 2, (plain.stdout, plain.stderr)
    finally:
        server.close()


def test_signals_end_in_killed_or_crashed(sandbox):
    killed = sandbox.run("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)")
    assert (killed.status, killed.signal, killed.detail) == ("killed", 9, "ended by SIGKILL")
    crashed = sandbox.run("import ctypes\nctypes.string_at(0)")
    assert crashed.status == "crashed" and crashed.detail == "ended by SIGSEGV"


def test_files_argv_and_the_channel(sandbox):
    result = sandbox.run("import os, sys\nprint(open('data.txt').read(), sys.argv[1])\n"
                         "os.write(int(sys.argv[-1]), b'to the caller')", files={"data.txt": "hello"}, argv=("x",),
                         channel=True)
    assert result.status == "ok" and result.stdout == "hello x\n" and result.channel == "to the caller"
    with pytest.raises(ValueError, match=r"sandbox limit cpu_s = 0 must be an integer >= 1"):
        Limits(cpu_s=0)
    with pytest.raises(ValueError, match=r"sandbox limit wall_s = inf must be a finite number"):
        Limits(wall_s=float("inf"))


def test_a_broken_sandbox_is_a_result_not_an_exception():
    broken = Sandbox(FAST, interpreters=("/nonexistent/python3",))
    result = broken.run("print(1)")
    assert result.status == "sandbox_error" and "no interpreter" in result.detail
    bad_name = Sandbox(FAST).run("print(1)", files={"../x": "y"})
    assert bad_name.status == "sandbox_error" and "plain name" in bad_name.detail


def test_runs_in_parallel_threads_stay_apart():
    sandbox = Sandbox(FAST, workers=3)
    results = sandbox.map(lambda i: sandbox.run(f"import os\nopen('mine', 'w').write('{i}')\nprint(open('mine').read())"),
                          range(6))
    assert [r.stdout for r in results] == [f"{i}\n" for i in range(6)]
    if os.geteuid() == 0:
        assert len({r.uid for r in results}) == 6
    # more threads than workers: the semaphore bounds the runs in flight
    running, peak, lock = [0], [0], threading.Lock()
    original = sandbox._run

    def counting(*args):
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        try:
            return original(*args)
        finally:
            with lock:
                running[0] -= 1

    sandbox._run = counting
    threads = [threading.Thread(target=sandbox.run, args=("import time\ntime.sleep(0.2)",)) for _ in range(7)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert peak[0] == 3


def test_without_landlock_the_mounts_are_read_only():
    sandbox = Sandbox(FAST, landlock=False)
    target = Path("/tmp") / f"onepath-escape-{secrets.token_hex(4)}"
    result = sandbox.run(f"open('ok', 'w').write('1')\nopen({str(target)!r}, 'w').write('x')")
    assert result.enforcement["filesystem"].startswith("read-only mounts")
    assert result.status == "error" and "Read-only file system" in result.detail
    assert not target.exists()


NOT_ROOT = """
import json, os, secrets, sys
sys.path.insert(0, sys.argv[1])
from onepath.tasks.sandbox import Limits, Sandbox
sandbox = Sandbox(Limits(cpu_s=1, wall_s=3))
target = f"/tmp/onepath-escape-{secrets.token_hex(4)}"
out = {"uid": os.getuid()}
for name, code in {"ok": "print(1)", "write": f"open({target!r}, 'w')", "loop": "while True: pass",
                   "fork": "import os\\nn = 0\\nwhile True:\\n    try:\\n        pid = os.fork()\\n    except OSError:\\n"
                           "        break\\n    if pid == 0:\\n        import time\\n        time.sleep(30)\\n"
                           "        os._exit(0)\\n    n += 1\\nprint(n)"}.items():
    r = sandbox.run(code)
    out[name] = [r.status, r.stdout.strip(), r.detail, list(r.unenforced), r.enforcement.get("processes")]
out["escaped"] = os.path.exists(target)
print(json.dumps(out))
"""


@pytest.mark.skipif(os.geteuid() != 0 or not os.access("/usr/bin/python3", os.X_OK),
                    reason="runs the non-root path as uid 65534 with /usr/bin/python3")
def test_as_a_user_the_sandbox_uses_a_user_namespace():
    run = subprocess.run(["/usr/bin/python3", "-I", "-c", NOT_ROOT, str(REPO)], user=65534, group=65534,
                         extra_groups=[], capture_output=True, text=True, timeout=60, cwd="/tmp", env={"PATH": "/usr/bin"})
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    assert out["uid"] == 65534
    assert out["ok"][:2] == ["ok", "1"] and out["ok"][3] == []
    assert "user namespace" in out["ok"][4]
    assert out["write"][0] == "error" and "Permission" in out["write"][2] and not out["escaped"]
    assert out["loop"][0] == "timeout"
    assert out["fork"][:2] == ["ok", str(Limits().processes - 1)]


def test_kill_uid_kills_every_process_of_a_uid():
    if os.geteuid() != 0:
        pytest.skip("needs root to run processes as another uid")
    uid = 1_999_999_000 + os.getpid() % 1000
    procs = [subprocess.Popen(["sleep", "60"], user=uid, group=uid, extra_groups=[]) for _ in range(3)]
    assert sorted(processes_of(uid)) == sorted(p.pid for p in procs)
    assert kill_uid(uid) == 3
    for p in procs:
        assert p.wait(5) == -9
    assert processes_of(uid) == []


def test_an_unenforced_limit_warns_once_and_strict_refuses_before_running(monkeypatch):
    from onepath.tasks import sandbox as module
    real = module.enforcement
    monkeypatch.setattr(module, "enforcement", lambda ready, limits: {**real(ready, limits), "network": None})
    loose = Sandbox(FAST)
    with pytest.warns(RuntimeWarning, match=r"sandbox: this machine does not enforce network \(.*network: NOT ENFORCED"):
        assert loose.run("print(1)").unenforced == ("network",)
    assert loose.run("print(1)").status == "ok"  # warned once: pytest's filter would raise on a second warning
    strict = Sandbox(FAST, strict=True)
    with pytest.raises(RuntimeError, match=r"does not enforce network .*Sandbox\(strict=True\) refuses to run"):
        strict.run("print(1)")  # refused on the probe's report, before the program runs
    assert strict.probe().unenforced == ("network",)
