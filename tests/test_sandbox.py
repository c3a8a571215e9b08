"""The sandbox (node/environments/sandbox.py) against hostile programs, each beside an honest control.

Every hostile program must end within its wall-clock bound without the result `ok`, and leave the host
as it was: no process left in its pid namespace, the test's secret unread and untouched, nothing written
outside, no connection reaching the test's listener. Where bwrap is missing or cannot create namespaces
these tests skip with the reason; the refusal itself is tested with a real bwrap made to fail.
"""

from __future__ import annotations

import os
import select
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from prime_node.node.environments.sandbox import (
    SANDBOX_VERSION,
    SandboxLimits,
    SandboxResult,
    run_sandboxed,
    sandbox_interpreter,
)

from support.sandbox import processes_in, sandbox_skip_reason, watch_sandboxes

SKIP = sandbox_skip_reason()
needs_sandbox = pytest.mark.skipif(SKIP is not None, reason=SKIP or "")
LIMITS = SandboxLimits(wall_s=6, cpu_s=2, memory_mb=256, processes=8, output_bytes=1 << 16)
# Killing and tearing down a sandbox on a loaded 2-core machine: what a run may take beyond wall_s.
KILL_MARGIN_S = 3.0
TESTS = Path(__file__).parent


def run(program: str, stdin: bytes = b"", limits: SandboxLimits = LIMITS) -> SandboxResult:
    """Runs `program` in the sandbox and checks the host-side promises every run keeps."""
    with watch_sandboxes() as watch:
        started = time.monotonic()
        result = run_sandboxed(textwrap.dedent(program), stdin, limits)
        elapsed = time.monotonic() - started
    assert elapsed < limits.wall_s + KILL_MARGIN_S, f"the run took {elapsed:.1f} s"
    assert watch.leftovers() == [], "processes outlived their sandbox"
    return result


@needs_sandbox
def test_honest_programs_pass_and_report_their_status() -> None:
    result = run(
        """
        import collections, fractions, heapq, itertools, json, math, re, sys, threading
        numbers = list(map(int, sys.stdin.read().split()))
        out = []
        threading.Thread(target=lambda: out.append(sum(numbers))).start()
        while not out:
            pass
        sys.setrecursionlimit(5000)
        depth = lambda n: 0 if n == 0 else 1 + depth(n - 1)
        with open("/tmp/scratch", "w") as scratch:  # the private /tmp is writable
            scratch.write("ok")
        print(out[0], depth(2000), math.isqrt(10**20), open("/tmp/scratch").read())
        """,
        b"1 2 3 4\n",
    )
    assert result.ok and result.stdout == b"10 2000 10000000000 ok\n", result
    failed = run("import sys\nprint('partial')\nsys.exit(3)")
    assert (failed.exit_code, failed.limit, failed.ok, failed.stdout) == (3, None, False, b"partial\n")
    crashed = run("raise ValueError('boom')")
    assert crashed.exit_code == 1 and b"ValueError: boom" in crashed.stderr and not crashed.ok
    unencodable = run("print('\udc80')")  # a str no UTF-8 file can hold: the interpreter refuses it
    assert unencodable.exit_code == 1 and b"SyntaxError" in unencodable.stderr


@needs_sandbox
def test_the_same_program_prints_the_same_on_every_run() -> None:
    # Validators recompute rewards: what a program sees must not vary (hash seed, environment, identity).
    program = "import os, sys\nprint(sorted(os.environ.items()), os.getuid(), os.uname().nodename)\n"
    program += "print(list({'apple', 'pear', 'fig', 'kiwi'}), hash('prime'), sys.version_info[:2])"
    first, second = run(program), run(program)
    assert first.ok and first.stdout == second.stdout
    assert b"'PYTHONHASHSEED', '0'" in first.stdout and b"1000 sandbox" in first.stdout
    assert SANDBOX_VERSION.endswith(f"python/{sys.version_info.major}.{sys.version_info.minor}")


@needs_sandbox
def test_fork_bomb_is_capped_and_leaves_nothing() -> None:
    crashing = run("import os\nwhile True:\n    os.fork()", limits=LIMITS.model_copy(update={"wall_s": 3}))
    assert not crashing.ok and crashing.limit in ("processes", "wall"), crashing
    # Children that survive the refusal and sleep: the cap, not a crash, is all that holds them.
    with watch_sandboxes() as watch:
        sleeping = run_sandboxed(
            "import os, time\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        time.sleep(30)",
            b"",
            LIMITS.model_copy(update={"wall_s": 3}),
        )
    assert sleeping.limit == "wall" and watch.leftovers() == [], sleeping
    # the program's tasks at most, plus bwrap's init (the poll may see a task that has just exited)
    assert 2 <= len(watch.pids) <= LIMITS.processes + 3, watch.pids
    honest = run("import os\nif os.fork() == 0:\n    os._exit(0)\nos.wait()\nprint('forked')")
    assert honest.ok and honest.stdout == b"forked\n"


@needs_sandbox
def test_unbounded_allocation_hits_the_memory_limit() -> None:
    result = run("chunks = []\nwhile True:\n    chunks.append(bytearray(1 << 20))")
    assert not result.ok and result.limit == "memory", result
    honest = run("print(len(bytearray(100 << 20)))")  # 100 MiB fits in 256
    assert honest.ok and honest.stdout == b"104857600\n"


@needs_sandbox
def test_loops_are_stopped_by_cpu_time_or_the_wall_clock() -> None:
    spin = run("while True:\n    pass", limits=LIMITS.model_copy(update={"cpu_s": 1, "wall_s": 8}))
    assert not spin.ok and spin.limit in ("cpu", "wall"), spin
    # Ignoring SIGXCPU only buys the second before the hard limit's SIGKILL.
    stubborn = run(
        "import signal\nsignal.signal(signal.SIGXCPU, signal.SIG_IGN)\nwhile True:\n    pass",
        limits=LIMITS.model_copy(update={"cpu_s": 1, "wall_s": 8}),
    )
    assert not stubborn.ok and stubborn.limit in ("cpu", "wall"), stubborn
    asleep = run("import time\ntime.sleep(3600)", limits=LIMITS.model_copy(update={"wall_s": 1.5}))
    assert not asleep.ok and asleep.limit == "wall" and asleep.exit_code is None, asleep


@needs_sandbox
def test_huge_output_is_cut_at_the_cap() -> None:
    for stream in ("stdout", "stderr"):
        result = run(f"import sys\nwhile True:\n    sys.{stream}.write('x' * 65536)")
        assert not result.ok and result.limit == "output", result
        kept = result.stdout if stream == "stdout" else result.stderr
        assert len(kept) == (LIMITS.output_bytes if stream == "stdout" else LIMITS.stderr_bytes)
    honest = run("print('y' * 60000)")  # just under the 64 KiB cap
    assert honest.ok and len(honest.stdout) == 60001


@needs_sandbox
def test_no_network_even_to_the_hosts_loopback() -> None:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        result = run(
            f"""
            import socket
            for attempt in (lambda: socket.create_connection(("127.0.0.1", {port}), timeout=2),
                            lambda: socket.getaddrinfo("example.com", 80),
                            lambda: socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b"x", ("8.8.8.8", 53))):
                try:
                    attempt()
                    print("reached")
                except OSError as exc:
                    print("refused", type(exc).__name__)
            print(socket.if_nameindex())
            """
        )
        assert result.ok and b"reached" not in result.stdout, result
        assert result.stdout.count(b"refused") == 3 and b"[(1, 'lo')]" in result.stdout
        listener.setblocking(False)
        with pytest.raises(BlockingIOError):
            listener.accept()  # nothing from the sandbox is waiting in the backlog
        # The control: the listener does accept, from the host.
        with socket.create_connection(("127.0.0.1", port), timeout=2):
            listener.settimeout(5)
            listener.accept()[0].close()


@needs_sandbox
def test_files_outside_are_invisible_and_unwritable(tmp_path: Path) -> None:
    secret = tmp_path / "secret.key"
    secret.write_text("hunter2")
    os.chmod(tmp_path, 0o755)  # readable to uid 65534 too: only the sandbox may hide it
    os.chmod(secret, 0o644)
    targets = [str(secret), str(Path.home() / ".ssh"), str(Path.home()), "/etc/passwd", "/proc/1/environ"]
    targets += [str(TESTS), "/work", "/root/.prime-node", "/var", "/run"]
    result = run(
        f"""
        import os
        for path in {targets!r}:
            try:
                print("READ", path, open(path).read()[:40])
            except OSError as exc:
                print("no", path, type(exc).__name__)
        for path in ({str(tmp_path / "pwned")!r}, "/pwned", "/usr/lib/pwned", "/sandbox/main.py", "/dev/shm/x"):
            try:
                open(path, "w").write("x")
                print("WROTE", path)
            except OSError as exc:
                print("no", path, type(exc).__name__)
        """
    )
    assert result.ok, result
    assert b"READ" not in result.stdout and b"WROTE" not in result.stdout and b"hunter2" not in result.stdout
    assert secret.read_text() == "hunter2" and not (tmp_path / "pwned").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["secret.key"]
    listing = run("import os\nprint(sorted(os.listdir('/')), os.listdir('/etc'), sorted(os.listdir('/usr')))")
    top, etc, usr = listing.stdout.decode().splitlines()[0].split("] ")
    assert set(eval(top + "]")) <= {"dev", "etc", "lib", "lib32", "lib64", "libx32", "sandbox", "tmp", "usr"}
    assert etc == "['ld.so.cache'" and set(eval(usr)) <= {"bin", "lib", "lib32", "lib64", "local"}, listing


SITE_PACKAGE = """
import os, site, sys
for directory in site.getsitepackages():
    for name in sorted(os.listdir(directory)) if os.path.isdir(directory) else ():
        if name.isidentifier() and os.path.isfile(os.path.join(directory, name, "__init__.py")):
            print(name)
            sys.exit()
"""


@needs_sandbox
def test_installed_packages_are_hidden() -> None:
    # What is installed differs between machines; a program must see only the standard library.
    python = sandbox_interpreter()
    installed = subprocess.run([python, "-I", "-c", SITE_PACKAGE], capture_output=True, text=True, timeout=60)
    name = installed.stdout.strip() or "pip"
    result = run(
        f"from importlib.util import find_spec\nprint(find_spec({name!r}), find_spec('json') is not None)"
    )
    assert result.ok and result.stdout == b"None True\n", result
    if installed.stdout:  # the control: the same interpreter outside the sandbox does find it
        outside = f"import importlib.util as u; print(u.find_spec({name!r}) is not None)"
        assert (
            subprocess.run([python, "-I", "-c", outside], capture_output=True, timeout=60).stdout == b"True\n"
        )


@needs_sandbox
def test_escape_attempts_fail_and_leave_nothing_behind() -> None:
    # Each attempt prints one line; the run then leaves a setsid'd daemon that cleared its death signal,
    # which the end of the run must kill anyway.
    result = run(
        f"""
        import ctypes, os, signal, time
        libc = ctypes.CDLL(None, use_errno=True)
        def attempt(name, call):
            try:
                value = call()
            except OSError as exc:
                value = exc.errno
            print(name, value, ctypes.get_errno())
        attempt("ptrace-init", lambda: libc.ptrace(16, 1, 0, 0))  # PTRACE_ATTACH to bwrap's init
        attempt("unshare-user", lambda: libc.unshare(0x10000000))
        attempt("unshare-mount", lambda: libc.unshare(0x00020000))
        os.makedirs("/tmp/p", exist_ok=True)
        attempt("mount-proc", lambda: libc.mount(b"proc", b"/tmp/p", b"proc", 0, None))
        attempt("proc-tricks", lambda: len(os.listdir("/proc/1/root")))
        attempt("kill-host-parent", lambda: os.kill({os.getpid()}, signal.SIGKILL))
        attempt("kill-everything", lambda: os.kill(-1, signal.SIGKILL))
        attempt("kill-init", lambda: os.kill(1, signal.SIGKILL))
        attempt("keyring", lambda: libc.syscall(250, 0, -3, 0, 0, 0))  # KEYCTL_GET_KEYRING_ID @u
        if os.fork() == 0:
            os.setsid()
            libc.prctl(1, 0, 0, 0, 0)  # PR_SET_PDEATHSIG 0
            if os.fork() == 0:
                os.close(1)
                os.close(2)
                time.sleep(3600)
            os._exit(0)
        os.wait()
        time.sleep(0.5)
        print("done")
        """
    )
    assert result.ok, result
    lines = dict(line.split(" ", 1) for line in result.stdout.decode().splitlines() if " " in line)
    assert lines["ptrace-init"].startswith("-1 1"), lines  # EPERM (seccomp)
    assert lines["unshare-user"].startswith("-1") and lines["unshare-mount"].startswith("-1"), lines
    assert lines["mount-proc"].startswith("-1"), lines
    assert lines["proc-tricks"].startswith("2 "), lines  # ENOENT: there is no /proc at all
    assert lines["kill-host-parent"].startswith("3 "), lines  # ESRCH: the host's pids do not exist here
    assert lines["keyring"].startswith("-1 1"), lines
    assert result.stdout.endswith(b"done\n")
    # A daemon that outlives the main program is killed with the sandbox (run() checked no leftovers);
    # one still running at the wall-clock limit too.
    lingering = run(
        "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(3600)\ntime.sleep(3600)",
        limits=LIMITS.model_copy(update={"wall_s": 1.5}),
    )
    assert lingering.limit == "wall"


SCORER = """
import sys
from prime_node.node.environments.sandbox import SandboxLimits, check_sandbox, run_sandboxed
check_sandbox()  # the probe's own sandboxes come and go before the watch starts
print("ready", flush=True)
run_sandboxed(sys.argv[1], b"", SandboxLimits(wall_s=60))
print("finished", flush=True)
"""


@needs_sandbox
def test_a_sandbox_dies_with_its_scorer() -> None:
    # A scorer (node or validator worker) killed mid-run must not leave the program running.
    program = textwrap.dedent(
        """
        import ctypes, os, time
        ctypes.CDLL(None).prctl(1, 0, 0, 0, 0)  # clear its own death signal
        os.setsid()
        if os.fork() == 0:
            time.sleep(3600)
        time.sleep(3600)
        """
    )
    scorer = subprocess.Popen([sys.executable, "-c", SCORER, program], stdout=subprocess.PIPE)
    try:
        assert scorer.stdout is not None
        ready, _, _ = select.select([scorer.stdout], [], [], 60)
        assert ready and scorer.stdout.readline() == b"ready\n", "the scorer did not start"
        with watch_sandboxes(scorer.pid) as watch:
            deadline = time.monotonic() + 30
            while len(watch.pids) < 3 and time.monotonic() < deadline:  # init, program, its child
                time.sleep(0.02)
            running = processes_in(watch.namespaces)
            assert len(watch.pids) >= 3 and len(running) >= 3, (watch.pids, running)
            scorer.send_signal(signal.SIGKILL)
            scorer.wait(10)
        assert watch.leftovers(within_s=10) == [], "the sandbox outlived its scorer"
        assert scorer.stdout.read() == b"", "the run cannot have finished"
    finally:
        scorer.kill()
        scorer.wait()


@needs_sandbox
def test_file_size_and_tmp_are_capped() -> None:
    limits = LIMITS.model_copy(update={"tmp_mb": 4})
    one_big = run("open('/tmp/big', 'wb').write(b'x' * (8 << 20))", limits=limits)
    assert not one_big.ok and one_big.limit == "file_size", one_big
    many = run(
        "for i in range(8):\n    open(f'/tmp/f{i}', 'wb').write(b'x' * (1 << 20))", limits=limits
    )  # each under the file limit, together over the tmpfs size
    assert not many.ok and many.limit == "file_size", many
    honest = run("open('/tmp/f', 'wb').write(b'x' * (1 << 20))\nprint('ok')", limits=limits)
    assert honest.ok


def test_no_sandbox_is_a_clear_refusal_not_a_crash(tmp_path: Path) -> None:
    # Without bwrap on PATH (runs everywhere, bwrap or not): the refusal names the missing package.
    probe = (
        "from prime_node.node.environments.sandbox import check_sandbox, SandboxUnavailable\n"
        "try:\n    print(check_sandbox())\nexcept SandboxUnavailable as exc:\n    print('REFUSED', exc)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], env={"PATH": str(tmp_path)}, capture_output=True, timeout=60
    )
    assert done.stdout.startswith(b"REFUSED no sandbox: bubblewrap (bwrap) is not installed"), done
    assert b"apt-get install bubblewrap" in done.stdout


@needs_sandbox
def test_bwrap_without_namespaces_is_refused_with_the_fix() -> None:
    # A real bwrap made to fail as in a default Docker container (seccomp refusing new namespaces).
    probe = (
        "from prime_node.node.environments.sandbox import check_sandbox, SandboxUnavailable\n"
        "try:\n    print(check_sandbox())\nexcept SandboxUnavailable as exc:\n    print('REFUSED', exc)\n"
    )
    if os.uname().machine != "x86_64":
        pytest.skip("the Docker-like seccomp filter of support/sandbox.py is written for x86_64")
    done = subprocess.run(
        [sys.executable, "-m", "support.sandbox", sys.executable, "-c", probe],
        cwd=TESTS,
        capture_output=True,
        timeout=60,
    )
    assert done.stdout.startswith(b"REFUSED no working sandbox"), done
    assert b"namespace" in done.stdout and b"seccomp=unconfined" in done.stdout
