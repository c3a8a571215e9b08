"""Runs one untrusted Python program on one stdin inside a bubblewrap sandbox, with hard limits.

Code environments execute programs written by models on contributors' machines and again on validators',
so the program is hostile: it may fork-bomb, allocate without bound, loop, flood its output, open sockets,
read the operator's keys or try to outlive its scorer. `run_sandboxed` confines it with Debian's
`bubblewrap` (bwrap) and kernel resource limits, and always returns a `SandboxResult`; `check_sandbox`
says whether a sandbox works on this machine, and code environments refuse to start when it does not.

What the program gets (docs/environments.md, "Sandbox", has the threat model):
- its own user, pid, network, IPC, UTS and cgroup namespaces; no network at all (a private loopback only),
  no further user namespaces, no capabilities, a new session (no terminal), killed with its scorer;
- a root file system holding only what the interpreter needs, read-only: the Python binary, its standard
  library (its site-packages hidden, so every machine offers the same modules), the system's shared
  libraries; a private size-capped tmpfs as /tmp and working directory; no /proc, /sys, /etc or home;
- CPU-time, address-space, task (process + thread), file-size, open-file and stack limits set inside the
  sandbox, stdout and stderr read with a byte cap, and a wall-clock deadline that kills the whole tree.

When prime-node runs as root the sandbox runs as uid 65534 instead: RLIMIT_NPROC is never enforced for a
process whose host uid is 0, and a sandbox that somehow escaped its mounts should hold nobody's rights.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import selectors
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Literal

import psutil
from pydantic import BaseModel, ConfigDict, Field

from ..errors import NodeError, OperatorActionNeeded
from .seccomp import seccomp_filter

log = logging.getLogger(__name__)

# Bump when anything a program can observe changes (mounts, environment, limits' meaning, launcher):
# it is part of every code environment's identity, so peers with another sandbox disagree loudly.
SANDBOX_POLICY = 1
# The program's interpreter is one of the host's with this major.minor (the same on every peer).
PYTHON_VERSION = f"{sys.version_info.major}.{sys.version_info.minor}"
SANDBOX_VERSION = f"bwrap-sandbox/{SANDBOX_POLICY} python/{PYTHON_VERSION}"

PROGRAM_PATH = "/sandbox/main.py"
WORK_DIR = "/tmp"
SANDBOX_UID = 1000  # what the program sees as its uid and gid, whoever runs prime-node
NOBODY = 65534  # the host uid the sandbox runs as when prime-node runs as root
# Rough room for the sandbox's own start (bwrap, the launcher, the interpreter) on top of a program's limit.
START_MARGIN_S = 2.0
# The environment is fixed so that a program behaves the same on every peer: the hash seed pins the order
# of sets and dicts of strings, one malloc arena keeps threads inside the address-space limit.
_ENVIRONMENT = {
    "HOME": WORK_DIR,
    "LANG": "C.UTF-8",
    "LC_ALL": "C.UTF-8",
    "MALLOC_ARENA_MAX": "1",
    "PYTHONDONTWRITEBYTECODE": "1",
    "PYTHONHASHSEED": "0",
    "PYTHONIOENCODING": "utf-8",
    "PYTHONUTF8": "1",
    "TZ": "UTC",
}
# Runs first inside the sandbox (after bwrap made the user namespace, so RLIMIT_NPROC counts this
# sandbox's tasks only), sets every limit soft = hard (the CPU hard limit one second later, so SIGXCPU
# comes first), then becomes the program's interpreter. argv: the limits in _RLIMITS order, the interpreter.
_RLIMITS = ("CPU", "AS", "NPROC", "FSIZE", "NOFILE", "STACK", "CORE", "MEMLOCK", "MSGQUEUE")
_LAUNCHER = (
    "import os,resource as r,sys\n"
    f"for n,v in zip({_RLIMITS!r},map(int,sys.argv[1:{len(_RLIMITS) + 1}])):\n"
    " r.setrlimit(getattr(r,'RLIMIT_'+n),(v,v+1 if n=='CPU' else v))\n"
    f"e=sys.argv[{len(_RLIMITS) + 1}]\n"
    f"os.execv(e,[e,'-s',{PROGRAM_PATH!r}])\n"
)
_STATUS_SIGNALLED = 128  # bwrap exits with 128 + N when the program died of signal N
_STATUS_BYTES = 4096  # of bwrap's JSON status lines: the first (the init's pid) is all we read


class SandboxError(NodeError):
    """A sandboxed run could not be set up (never raised for what the program itself does)."""


class SandboxUnavailable(SandboxError, OperatorActionNeeded):
    """No working sandbox on this machine; the message says why and what the operator can do."""


class SandboxLimits(BaseModel):
    """Limits of one sandboxed run. All are part of a code environment's identity: peers must agree."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    wall_s: float = Field(
        4.0, gt=0, le=120, description="Wall-clock limit of one run (program and start), s."
    )
    cpu_s: int = Field(2, ge=1, le=120, description="CPU-time limit of each process (RLIMIT_CPU), seconds.")
    memory_mb: int = Field(256, ge=32, le=16384, description="Address-space limit of each process, MiB.")
    processes: int = Field(
        8, ge=1, le=256, description="Tasks (processes and threads) the program may have at once."
    )
    output_bytes: int = Field(
        1 << 20, ge=1, le=64 << 20, description="Largest stdout kept; more kills the run (limit 'output')."
    )
    stderr_bytes: int = Field(
        64 << 10, ge=1, le=16 << 20, description="Largest stderr kept; more kills the run (limit 'output')."
    )
    tmp_mb: int = Field(
        16, ge=1, le=1024, description="Size of the private /tmp and of the largest file, MiB."
    )
    open_files: int = Field(64, ge=8, le=4096, description="Open file descriptors per process.")
    stack_mb: int = Field(8, ge=1, le=1024, description="Stack size of the main thread, MiB.")


LimitHit = Literal["wall", "cpu", "memory", "processes", "output", "file_size"]


class SandboxResult(BaseModel):
    """What one run did. `limit` is certain for wall, cpu and output (the sandbox enforced them); memory,
    processes and file_size are read from the program's own error report, so a program can fake them (it
    then failed anyway: they are only reported when it exited with an error)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    exit_code: int | None = Field(
        ..., description="The program's exit status (128+N: signal N); None if killed."
    )
    limit: LimitHit | None = Field(..., description="The limit the run hit, if one was seen.")
    stdout: bytes = Field(..., description="Standard output, at most output_bytes.")
    stderr: bytes = Field(..., description="Standard error, at most stderr_bytes.")
    wall_s: float = Field(..., ge=0, description="Wall-clock time of the run, sandbox start included.")

    @property
    def ok(self) -> bool:
        """The program ran to completion within every limit and exited with status 0."""
        return self.exit_code == 0 and self.limit is None


@dataclass(frozen=True)
class _Runtime:
    """How to start a sandbox on this machine, found once per process by `_runtime`."""

    bwrap: str
    python: str  # the interpreter inside, by its real path (bound at the same path)
    mounts: tuple[str, ...]  # bwrap arguments that build the read-only root
    seccomp: bytes  # the compiled filter (seccomp.py)
    run_as: int | None  # host uid (and gid) to drop to before bwrap; None: stay as we are

    def describe(self) -> str:
        who = f"uid {self.run_as}" if self.run_as is not None else f"uid {os.getuid()}"
        return f"{SANDBOX_VERSION}: {self.bwrap}, {self.python}, as {who}"


def check_sandbox() -> str:
    """A one-line description of the working sandbox; SandboxUnavailable saying why there is none."""
    return _runtime().describe()


def sandbox_interpreter() -> str:
    """The host path of the Python that runs programs in the sandbox (SandboxUnavailable if none)."""
    return _runtime().python


def run_sandboxed(
    program: str | bytes, stdin: bytes = b"", limits: SandboxLimits | None = None
) -> SandboxResult:
    """Run `program` (Python source) on `stdin` in the sandbox; the result says how it ended.

    Never raises for anything the program does; SandboxUnavailable when no sandbox works here.
    """
    runtime = _runtime()
    source = program.encode("utf-8", "surrogatepass") if isinstance(program, str) else program
    return _run(runtime, source, stdin, limits or SandboxLimits())


def _argv(
    runtime: _Runtime, program_fd: int, seccomp_fd: int, status_fd: int, limits: SandboxLimits
) -> list[str]:
    tmp_bytes = limits.tmp_mb << 20
    args = [
        runtime.bwrap,
        "--unshare-user",
        "--unshare-pid",
        "--unshare-net",
        "--unshare-ipc",
        "--unshare-uts",
        "--unshare-cgroup-try",
        "--disable-userns",  # no nested user namespaces: the kernel's largest attack surface stays shut
        "--uid",
        str(SANDBOX_UID),
        "--gid",
        str(SANDBOX_UID),
        "--hostname",
        "sandbox",
        "--die-with-parent",
        "--new-session",
        "--cap-drop",
        "ALL",
        "--clearenv",
        "--seccomp",
        str(seccomp_fd),
        "--json-status-fd",  # tells us the host pid of the sandbox's init, the process a kill must reach
        str(status_fd),
    ]
    for name, value in sorted({**_ENVIRONMENT, "PATH": os.path.dirname(runtime.python)}.items()):
        args += ["--setenv", name, value]
    args += runtime.mounts
    args += ["--dev", "/dev", "--remount-ro", "/dev"]  # null, zero, urandom; nothing writable
    args += ["--size", str(tmp_bytes), "--tmpfs", WORK_DIR, "--chdir", WORK_DIR]
    args += ["--ro-bind-data", str(program_fd), PROGRAM_PATH]
    args += ["--remount-ro", "/"]  # bwrap's root is a tmpfs without a size: nothing may be written there
    rlimits = {
        "CPU": limits.cpu_s,
        "AS": limits.memory_mb << 20,
        "NPROC": limits.processes + 1,  # + bwrap's own init (pid 1), which runs as the sandbox user too
        "FSIZE": tmp_bytes,
        "NOFILE": limits.open_files,
        "STACK": limits.stack_mb << 20,
        "CORE": 0,
        "MEMLOCK": 0,
        "MSGQUEUE": 0,
    }
    args += [runtime.python, "-S", "-s", "-c", _LAUNCHER, *(str(rlimits[name]) for name in _RLIMITS)]
    args.append(runtime.python)
    return args


def _memfd(name: str, data: bytes) -> int:
    """A read-only descriptor of an anonymous in-memory file holding `data` (never a file on disk)."""
    writer = os.memfd_create(name, os.MFD_CLOEXEC)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(writer, view) :]
        # Read-only, so that the program cannot grow our memory by writing to its stdin.
        return os.open(f"/proc/self/fd/{writer}", os.O_RDONLY | os.O_CLOEXEC)
    finally:
        os.close(writer)


def _run(runtime: _Runtime, source: bytes, stdin: bytes, limits: SandboxLimits) -> SandboxResult:
    start = time.monotonic()
    program_fd = _memfd("program", source)
    stdin_fd = _memfd("stdin", stdin)
    seccomp_fd = _memfd("seccomp", runtime.seccomp)
    status_read, status_write = os.pipe2(os.O_CLOEXEC)
    drop: dict[str, Any] = {}
    if runtime.run_as is not None:
        drop = {"user": runtime.run_as, "group": runtime.run_as, "extra_groups": []}
    try:
        proc = subprocess.Popen(
            _argv(runtime, program_fd, seccomp_fd, status_write, limits),
            stdin=stdin_fd,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            pass_fds=(program_fd, seccomp_fd, status_write),
            start_new_session=True,  # bwrap's own process group, so that a kill never reaches us
            cwd="/",
            env={},
            **drop,
        )
    except OSError as exc:
        os.close(status_read)
        raise SandboxError(f"cannot start the sandbox ({runtime.bwrap}): {exc}") from exc
    finally:
        for fd in (program_fd, stdin_fd, seccomp_fd, status_write):
            os.close(fd)
    watch = _Watch(proc, status_read, limits)
    limit: LimitHit | None = None
    try:
        limit = watch.run(start + limits.wall_s)
    finally:
        # A limit, or an error while watching with the sandbox still running: end it before anything else.
        if limit is not None or proc.poll() is None:
            watch.kill()
        returncode = proc.wait()  # at once: bwrap has exited, or was SIGKILLed just now
        watch.close()
    status = None
    if limit is None:
        status = _STATUS_SIGNALLED - returncode if returncode < 0 else returncode  # bwrap itself signalled
    wall = time.monotonic() - start
    if limit is None and status != 0:
        limit = _inferred_limit(status, wall, bytes(watch.stderr), limits)
    return SandboxResult(
        exit_code=status,
        limit=limit,
        stdout=bytes(watch.stdout),
        stderr=bytes(watch.stderr),
        wall_s=round(wall, 6),
    )


class _Watch:
    """Reads a running sandbox's stdout, stderr and bwrap's status until it ends or breaks a limit."""

    def __init__(self, proc: subprocess.Popen[bytes], status_fd: int, limits: SandboxLimits) -> None:
        assert proc.stdout is not None and proc.stderr is not None
        self.proc = proc
        self.stdout, self.stderr, self.status = bytearray(), bytearray(), bytearray()
        self._caps = {
            proc.stdout.fileno(): (self.stdout, limits.output_bytes),
            proc.stderr.fileno(): (self.stderr, limits.stderr_bytes),
            status_fd: (self.status, _STATUS_BYTES),
        }
        self._status_fd = status_fd
        self._bwrap: int | None = None  # pidfd of bwrap, readable once it has exited
        self._init: int | None = None  # pidfd of the sandbox's pid 1 (-1: unknown), once bwrap told its pid

    def run(self, deadline: float) -> LimitHit | None:
        """Until bwrap has exited and every pipe is closed (nothing in the sandbox holds them), or a limit."""
        self._bwrap = os.pidfd_open(self.proc.pid)
        with selectors.DefaultSelector() as selector:
            for fd in self._caps:
                os.set_blocking(fd, False)
                selector.register(fd, selectors.EVENT_READ)
            selector.register(self._bwrap, selectors.EVENT_READ)
            while selector.get_map():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return "wall"
                for key, _ in selector.select(remaining):
                    if key.fd == self._bwrap:
                        selector.unregister(key.fd)
                        continue
                    buffer, cap = self._caps[key.fd]
                    chunk = os.read(key.fd, min(1 << 16, cap + 1 - len(buffer)))
                    if not chunk:
                        selector.unregister(key.fd)
                        continue
                    buffer += chunk
                    if len(buffer) > cap:
                        del buffer[cap:]
                        if key.fd != self._status_fd:
                            return "output"
                        selector.unregister(key.fd)  # bwrap's own status: nothing more is needed from it
                    if key.fd == self._status_fd and self._init is None:
                        self._init = self._open_init()
        return None

    def _open_init(self) -> int | None:
        """A pidfd of the sandbox's init from bwrap's first status line, checked to be bwrap's child (bwrap
        is not reaped yet, so neither its pid nor its child's can have been reused by another process)."""
        line, newline, _ = bytes(self.status).partition(b"\n")
        if not newline:
            return None
        try:
            pid = int(json.loads(line)["child-pid"])
            pidfd = os.pidfd_open(pid)
        except (ValueError, KeyError, TypeError, OSError):
            return -1  # gone already, or a bwrap that says something else: --die-with-parent remains
        try:
            parent: int | None = psutil.Process(pid).ppid()
        except psutil.Error:
            parent = None
        if parent != self.proc.pid:
            os.close(pidfd)
            return -1
        return pidfd

    def kill(self) -> None:
        """SIGKILL the sandbox's init (the kernel then kills everything in its pid namespace: setsid and
        double forks cannot leave it) and bwrap's process group."""
        if self._init is not None and self._init >= 0:
            try:
                signal.pidfd_send_signal(self._init, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def close(self) -> None:
        for fd in (self._bwrap, self._status_fd, self._init):
            if fd is not None and fd >= 0:
                os.close(fd)
        self.proc.stdout.close()  # type: ignore[union-attr]
        self.proc.stderr.close()  # type: ignore[union-attr]


def _inferred_limit(status: int | None, wall: float, stderr: bytes, limits: SandboxLimits) -> LimitHit | None:
    # SIGXCPU comes at the CPU limit, SIGKILL a second later to a program that ignores it (a SIGKILL
    # before cpu_s of wall time cannot be the CPU limit... unless several threads spun: close enough).
    if status == _STATUS_SIGNALLED + signal.SIGXCPU:
        return "cpu"
    if status == _STATUS_SIGNALLED + signal.SIGKILL and wall >= limits.cpu_s:
        return "cpu"
    tail = stderr[-2048:]
    if b"MemoryError" in tail:
        return "memory"
    if b"Resource temporarily unavailable" in tail or b"can't start new thread" in tail:
        return "processes"
    if b"File too large" in tail or b"No space left on device" in tail:
        return "file_size"
    return None


# Prints what the sandbox must mount for one interpreter; run by that interpreter, outside the sandbox.
_INTERPRETER_INFO = (
    "import json,os,site,sys,sysconfig\n"
    "print(json.dumps({'version':'%d.%d'%sys.version_info[:2],'executable':os.path.realpath(sys.executable),"
    "'dirs':[sysconfig.get_path('stdlib'),sysconfig.get_path('platstdlib'),sysconfig.get_config_var('LIBDIR')],"
    "'site':site.getsitepackages()}))\n"
)
# Where shared libraries live: bound read-only where they are directories, recreated where they are links.
_LIBRARY_DIRS = ("/usr/lib", "/usr/lib64", "/lib", "/lib64", "/lib32", "/libx32")
_PROBE_PROGRAM = "import sys\nprint(int(sys.stdin.read()) * 2)\n"
_INSTALL_HINT = (
    "install bubblewrap (Debian/Ubuntu: `apt-get install bubblewrap`; scripts/setup.sh does it when run "
    "as root)"
)
_NAMESPACE_HINT = (
    "bwrap cannot create its namespaces here. On Ubuntu 23.10+ allow unprivileged user namespaces "
    "(`sysctl kernel.apparmor_restrict_unprivileged_userns=0`, or an AppArmor profile for bwrap); in Docker "
    "the default seccomp and AppArmor profiles forbid them (run with `--security-opt seccomp=unconfined "
    "--security-opt apparmor=unconfined`); on older Debian `sysctl kernel.unprivileged_userns_clone=1`"
)

_runtime_lock = threading.Lock()
_runtime_found: _Runtime | SandboxUnavailable | None = None


def _runtime() -> _Runtime:
    """The sandbox set-up for this machine, probed once per process (a failure is remembered too)."""
    global _runtime_found
    with _runtime_lock:
        if _runtime_found is None:
            try:
                _runtime_found = _probe()
                log.info("sandbox: %s", _runtime_found.describe())
            except SandboxUnavailable as exc:
                _runtime_found = exc
        if isinstance(_runtime_found, SandboxUnavailable):
            raise _runtime_found
        return _runtime_found


def _under(path: str, roots: list[str]) -> bool:
    return any(path == root or path.startswith(root.rstrip("/") + "/") for root in roots)


def _mounts(info: dict[str, object]) -> tuple[str, ...]:
    """bwrap arguments for a read-only root with the interpreter, its stdlib and the shared libraries."""
    args: list[str] = []
    bound: list[str] = []
    for path in _LIBRARY_DIRS:
        if os.path.islink(path):
            args += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            args += ["--ro-bind", path, path]
            bound.append(path)
    args += ["--ro-bind-try", "/etc/ld.so.cache", "/etc/ld.so.cache"]
    executable = str(info["executable"])
    args += ["--ro-bind", executable, executable]
    for path in sorted({os.path.realpath(str(p)) for p in info["dirs"] if p}):  # type: ignore[attr-defined]
        if os.path.isdir(path) and not _under(path, bound):
            args += ["--ro-bind", path, path]
            bound.append(path)
    # Installed packages differ between machines; only the standard library is the same everywhere.
    for path in sorted({os.path.realpath(str(p)) for p in info["site"]}):  # type: ignore[attr-defined]
        if os.path.isdir(path) and _under(path, bound):
            args += ["--tmpfs", path, "--remount-ro", path]
    return tuple(args)


def _interpreters() -> list[str]:
    """Interpreters to try, best first: ours, then the system's of the same major.minor (when prime-node
    runs as root from an installation that uid 65534 cannot read, such as pyenv under /root)."""
    ours = getattr(sys, "_base_executable", None) or sys.executable
    found: list[str] = []
    for candidate in (ours, f"/usr/bin/python{PYTHON_VERSION}", f"/usr/local/bin/python{PYTHON_VERSION}"):
        real = os.path.realpath(candidate)
        if os.path.isfile(real) and os.access(real, os.X_OK) and real not in found:
            found.append(real)
    return found


def _probe() -> _Runtime:
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        raise SandboxUnavailable(f"no sandbox: bubblewrap (bwrap) is not installed; {_INSTALL_HINT}")
    seccomp = seccomp_filter()
    if seccomp is None:
        raise SandboxUnavailable(
            f"no sandbox: its seccomp filter knows x86_64 and aarch64, not {platform.machine()}"
        )
    run_as = NOBODY if os.geteuid() == 0 else None
    problems: list[str] = []
    for python in _interpreters():
        try:
            done = subprocess.run(
                [python, "-I", "-S", "-c", _INTERPRETER_INFO], capture_output=True, timeout=30, check=True
            )
            info = json.loads(done.stdout)
        except (OSError, subprocess.SubprocessError, ValueError) as exc:
            problems.append(f"with {python}: cannot inspect it ({exc})")
            continue
        if info.get("version") != PYTHON_VERSION:
            problems.append(f"with {python}: Python {info.get('version')}, not {PYTHON_VERSION}")
            continue
        runtime = _Runtime(
            bwrap=bwrap, python=str(info["executable"]), mounts=_mounts(info), seccomp=seccomp, run_as=run_as
        )
        try:
            result = _run(runtime, _PROBE_PROGRAM.encode(), b"21", SandboxLimits(wall_s=30))
        except SandboxError as exc:
            problems.append(f"with {python}: {exc}")
            continue
        if result.ok and result.stdout == b"42\n":
            return runtime
        said = result.stderr.decode("utf-8", "replace").strip().splitlines()
        problem = said[-1].rstrip(".") if said else f"the test program ended with status {result.exit_code}"
        if "namespace" in problem or "uid map" in problem:  # bwrap itself, whatever the interpreter
            raise SandboxUnavailable(f"no working sandbox: {bwrap} says: {problem}. {_NAMESPACE_HINT}")
        problems.append(f"with {python}: {problem}")
    if not problems:
        raise SandboxUnavailable(f"no sandbox: no Python {PYTHON_VERSION} interpreter found to run programs")
    hint = ""
    if run_as is not None and any("Permission denied" in p for p in problems):
        hint = (
            f". prime-node runs as root, so the sandbox runs as uid {run_as}, which must be able to read the "
            f"interpreter: install python{PYTHON_VERSION} system-wide (`apt-get install python{PYTHON_VERSION}`)"
            " or run prime-node as a normal user"
        )
    raise SandboxUnavailable(f"no working sandbox ({bwrap}): " + "; ".join(problems) + hint)
