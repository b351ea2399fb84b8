"""The sandbox's launcher, run as `python -I -S sandbox_launcher.py CONFIG_JSON` by onepath.tasks.sandbox.

Standard library only: it starts with the caller's rights and confines itself before the payload runs.
  launcher: new network, PID, IPC and mount namespaces (a user namespace too when not root), then
    forks the namespace's init;
  init (PID 1 there): dies with the launcher (PR_SET_PDEATHSIG) and, when the payload exits,
    exits too, which makes the kernel kill every process left in the namespace;
  payload: tmpfs work dir and /proc of its own, resource limits, no_new_privs, Landlock, the
    caller's uid dropped for one of the run's own when root, then exec of the interpreter.
Each stage writes one JSON line to the report pipe (never inherited by the payload's program):
{"namespaces": [...]}, {"ready": {...}} or {"error": "..."}, and {"exit": wait status, ...}.
docs/sandbox.md says what each step protects and what it does not.
"""
import ctypes
import errno
import json
import os
import resource
import signal
import sys

CLONE_NEWNS, CLONE_NEWIPC, CLONE_NEWUSER = 0x00020000, 0x08000000, 0x10000000
CLONE_NEWPID, CLONE_NEWNET = 0x20000000, 0x40000000
MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REC, MS_PRIVATE = 0x2, 0x4, 0x8, 0x4000, 0x40000
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS = 1, 38
SYS_LANDLOCK = {"create_ruleset": 444, "add_rule": 445, "restrict_self": 446}  # the same on x86-64 and arm64
SYS_MOUNT_SETATTR, AT_FDCWD, AT_RECURSIVE, MOUNT_ATTR_RDONLY = 442, -100, 0x8000, 0x1
# Landlock: the write rights it handles (reads and execution stay as the file modes allow)
FS_WRITE_FILE, FS_TRUNCATE = 1 << 1, 1 << 14
FS_WRITES = {1: sum(1 << b for b in (1, 4, 5, 6, 7, 8, 9, 10, 11, 12)), 2: 1 << 13, 3: FS_TRUNCATE}
NET_BIND_TCP, NET_CONNECT_TCP = 1, 2
SCOPE_ABSTRACT_UNIX_SOCKET, SCOPE_SIGNAL = 1, 2

libc = ctypes.CDLL(None, use_errno=True)


def check(result, what: str):
    if result == -1:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return result


def report(fd: int, record: dict) -> None:
    os.write(fd, (json.dumps(record) + "\n").encode())  # one write under PIPE_BUF: never interleaved


def unshare(cfg: dict) -> list[str]:
    """The namespaces this process gets; the caller learns from the report which ones it lacks."""
    wanted = {"net": CLONE_NEWNET, "pid": CLONE_NEWPID, "ipc": CLONE_NEWIPC, "mount": CLONE_NEWNS}
    uid, gid = os.getuid(), os.getgid()
    if uid != 0:
        # an unprivileged user gets the other namespaces inside a user namespace of its own
        if libc.unshare(CLONE_NEWUSER) == -1:
            return []
        with open("/proc/self/setgroups", "w") as f:
            f.write("deny")
        for name, outer in (("uid_map", uid), ("gid_map", gid)):
            with open(f"/proc/self/{name}", "w") as f:
                f.write(f"{outer} {outer} 1")
    if libc.unshare(sum(wanted.values())) == 0:
        got = list(wanted)
    else:
        got = [name for name, flag in wanted.items() if libc.unshare(flag) == 0]
    return (["user"] if uid != 0 else []) + got


def init(payload: int, fd: int) -> None:
    """PID 1 of the run's namespace: reap, and leave when the payload leaves (the kernel then kills the rest)."""
    while True:
        try:
            pid, status, usage = os.wait4(-1, 0)
        except ChildProcessError:
            os._exit(0)
        if pid == payload:
            report(fd, {"exit": status, "cpu_s": usage.ru_utime + usage.ru_stime, "maxrss_kib": usage.ru_maxrss})
            os._exit(0)


def tmpfs_workdir(cfg: dict) -> str:
    """Mount a tmpfs of cfg["disk_bytes"] on the work dir (the files written there before, copied in):
    what the program writes counts against it, not against the host's disk."""
    workdir = cfg["workdir"]
    files = {}
    for name in os.listdir(workdir):
        with open(os.path.join(workdir, name), "rb") as f:
            files[name] = f.read()
    check(libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None), "make / private")
    options = f"size={cfg['disk_bytes']},nr_inodes={cfg['max_files']},mode=0700".encode()
    check(libc.mount(b"tmpfs", workdir.encode(), b"tmpfs", MS_NOSUID | MS_NODEV, options), "mount the tmpfs")
    for name, data in files.items():
        with open(os.path.join(workdir, name), "wb") as f:
            f.write(data)
    return "tmpfs"


def own_proc() -> str:
    """A /proc of the new PID namespace: the host's processes, their command lines included, out of sight."""
    check(libc.mount(b"proc", b"/proc", b"proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None), "mount /proc")
    return "own"


def optional(step, *args) -> str | None:
    """A confinement step the machine may not allow: its mechanism, or None (the caller reports it unenforced)."""
    try:
        return step(*args)
    except OSError:
        return None


def limits(cfg: dict) -> None:
    cpu = cfg["cpu_s"]
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))  # SIGXCPU at cpu seconds, SIGKILL one later
    resource.setrlimit(resource.RLIMIT_AS, (cfg["memory_bytes"],) * 2)
    resource.setrlimit(resource.RLIMIT_NPROC, (cfg["processes"],) * 2)
    resource.setrlimit(resource.RLIMIT_FSIZE, (cfg["disk_bytes"],) * 2)
    resource.setrlimit(resource.RLIMIT_NOFILE, (cfg["open_files"],) * 2)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def landlock(workdir: str) -> str | None:
    """Writes only beneath workdir (and to /dev/null); with ABI 4+ no TCP bind or connect; with 6+ no
    signals or abstract unix sockets out of the sandbox. None when the kernel has no Landlock."""
    abi = libc.syscall(SYS_LANDLOCK["create_ruleset"], None, 0, 1)  # LANDLOCK_CREATE_RULESET_VERSION
    if abi < 1:
        return None
    fs = sum(bits for version, bits in FS_WRITES.items() if abi >= version)
    net = NET_BIND_TCP | NET_CONNECT_TCP if abi >= 4 else 0
    scoped = SCOPE_ABSTRACT_UNIX_SOCKET | SCOPE_SIGNAL if abi >= 6 else 0
    attr = (ctypes.c_uint64 * 3)(fs, net, scoped)
    size = 8 * (3 if abi >= 6 else 2 if abi >= 4 else 1)
    ruleset = check(libc.syscall(SYS_LANDLOCK["create_ruleset"], ctypes.byref(attr), size, 0), "landlock ruleset")

    class PathBeneath(ctypes.Structure):
        _pack_ = 1
        _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]

    file_rights = FS_WRITE_FILE | (FS_TRUNCATE if abi >= 3 else 0)
    for path, rights in ((workdir, fs), ("/dev/null", file_rights)):
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        rule = PathBeneath(rights, fd)
        check(libc.syscall(SYS_LANDLOCK["add_rule"], ruleset, 1, ctypes.byref(rule), 0), f"landlock rule {path}")
        os.close(fd)
    check(libc.syscall(SYS_LANDLOCK["restrict_self"], ruleset, 0), "landlock restrict_self")
    os.close(ruleset)
    return f"landlock ABI {abi}"


def readonly_root(workdir: str) -> str:
    """Without Landlock: every mount read-only in this mount namespace but the work dir's tmpfs."""
    class MountAttr(ctypes.Structure):
        _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64),
                    ("propagation", ctypes.c_uint64), ("userns_fd", ctypes.c_uint64)]

    for path, flags, attr in ((b"/", AT_RECURSIVE, MountAttr(MOUNT_ATTR_RDONLY, 0, 0, 0)),
                              (workdir.encode(), 0, MountAttr(0, MOUNT_ATTR_RDONLY, 0, 0))):
        check(libc.syscall(SYS_MOUNT_SETATTR, AT_FDCWD, path, flags, ctypes.byref(attr), ctypes.sizeof(attr)),
              f"mount_setattr {path.decode()}")
    return "read-only mounts"


def payload(cfg: dict, fd: int, namespaces: list[str]) -> None:
    """Confine this process and exec the interpreter; on failure report why and exit 127."""
    ready = {"namespaces": namespaces}
    try:
        if "mount" in namespaces:
            ready["disk"] = optional(tmpfs_workdir, cfg)
            if "pid" in namespaces:
                ready["proc"] = optional(own_proc)
        if cfg["uid"] is not None:
            os.chown(cfg["workdir"], cfg["uid"], cfg["uid"])
            for name in os.listdir(cfg["workdir"]):
                os.chown(os.path.join(cfg["workdir"], name), cfg["uid"], cfg["uid"])
        limits(cfg)
        check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
        filesystem = optional(landlock, cfg["workdir"]) if cfg["landlock"] else None
        if filesystem is None and ready.get("disk") == "tmpfs":  # the work dir must be a mount of its own
            filesystem = optional(readonly_root, cfg["workdir"])
        ready["filesystem"] = filesystem
        if cfg["uid"] is not None:
            os.setgroups([])
            os.setgid(cfg["uid"])
            os.setuid(cfg["uid"])
            ready["uid"] = cfg["uid"]
        os.chdir(cfg["workdir"])
        for interpreter in cfg["interpreters"]:
            if os.access(interpreter, os.X_OK):
                break
        else:
            raise OSError(errno.EACCES, f"no interpreter this user can run among {cfg['interpreters']}")
        ready["interpreter"] = interpreter
        for keep in cfg["pass_fds"]:
            os.set_inheritable(keep, True)
        report(fd, {"ready": ready})
        os.execve(interpreter, [interpreter, "-I", "-S", "-B", *cfg["argv"]], cfg["env"])
    except BaseException as e:  # noqa: BLE001 - whatever it is, the caller gets it as a sandbox_error
        report(fd, {"error": f"{type(e).__name__}: {e}", "ready": ready})
        os._exit(127)


def main() -> None:
    cfg = json.loads(sys.argv[1])
    fd = cfg["report_fd"]
    os.set_inheritable(fd, False)  # the launcher's own channel: closed at the payload's exec
    try:
        namespaces = unshare(cfg)
    except OSError as e:
        report(fd, {"error": f"namespaces: {e}"})
        os._exit(127)
    report(fd, {"namespaces": namespaces})
    if "pid" not in namespaces:
        payload(cfg, fd, namespaces)  # no init: the caller kills the run's processes by uid
    init_pid = os.fork()
    if init_pid == 0:
        # (a launcher killed before this line leaves the init in its session: the caller's killpg gets it)
        check(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "pdeathsig")
        child = os.fork()
        if child == 0:
            payload(cfg, fd, namespaces)
        init(child, fd)
    _, status = os.waitpid(init_pid, 0)
    os._exit(os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 1)


if __name__ == "__main__":
    main()
