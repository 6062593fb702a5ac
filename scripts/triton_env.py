#!/usr/bin/env python3
"""Run the real tritonserver unpacked by scripts/setup_tritonserver.sh (standard library only).

As a module::

    from triton_env import TritonServer
    with TritonServer("model_repository") as server:       # start() + wait_ready()
        client = tritonclient.grpc.InferenceServerClient(server.grpc_url)

As a command::

    python scripts/triton_env.py serve --model-repository model_repository [--http-port 8000 ...] [-- EXTRA ARGS]
    python scripts/triton_env.py command --model-repository model_repository   # print the shell line only

The Python backend runs model.py in ``triton_python_backend_stub``, which embeds libpython3.X: the stub must
match the interpreter whose packages model.py imports (``python=``, default: this interpreter). That
interpreter decides LD_LIBRARY_PATH (its libpython), PYTHONPATH (the repository root + its site-packages)
and which stub is used. Two quirks of these 2.51 stubs (pybind11 2.10) are handled here:

* with Python >= 3.11 the stub's interpreter ignores PYTHONPATH. It finds its prefix by looking up
  ``python3`` on PATH, so PATH starts with a small venv made under run/ whose .pth file applies PYTHONPATH
  (entries first, their .pth files read) while the interpreter starts, before numpy is imported;
* under numpy 2 every tensor the stub hands over is garbled (as_numpy() repeats the first element, outputs
  come back empty). When ``python`` has numpy >= 2, the numpy 1.26.4 that setup_tritonserver.sh unpacked
  into stub_site/3.X goes first on PYTHONPATH (torch and transformers run with it).

Set TRITON_HOME to use an unpacked server somewhere else than .deps/tritonserver.
"""

from __future__ import annotations

import argparse
import atexit
import functools
import hashlib
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Self

REPO_ROOT = Path(__file__).resolve().parents[1]
TRITON_HOME = Path(os.environ.get("TRITON_HOME", REPO_ROOT / ".deps" / "tritonserver"))
SERVER_DIR = (
    TRITON_HOME / "pytriton" / "tritonserver"
)  # the wheel's layout; its RPATHs rely on it
LIBS_DIR = TRITON_HOME / "nvidia_pytriton.libs"
RUN_DIR = TRITON_HOME / "run"  # made at server start, for this machine's interpreters
STUB = "triton_python_backend_stub"
_NO_PROXY = urllib.request.build_opener(
    urllib.request.ProxyHandler({})
)  # never send 127.0.0.1 to a proxy

# Read by the stub's interpreter at start-up (through a .pth file of the venv that stub_env() makes).
_PYTHONPATH_MODULE = """\
# Made by scripts/triton_env.py: the stub's embedded Python (>= 3.11) ignores PYTHONPATH; apply it here.
import os, site, sys
_want = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]
if _want:
    _before = list(sys.path)
    for _p in _want:
        site.addsitedir(_p)  # also reads the .pth files there (editable installs ...)
    sys.path[:] = [p for p in sys.path if p not in _before] + _before
"""

_QUERY = r"""
import json, os, sys, sysconfig
from importlib import metadata
v = sysconfig.get_config_var
try:
    numpy = metadata.version("numpy")
except metadata.PackageNotFoundError:
    numpy = None
print(json.dumps({
    "version": "%d.%d" % sys.version_info[:2],
    "full_version": "%d.%d.%d" % sys.version_info[:3],
    "base_executable": os.path.realpath(getattr(sys, "_base_executable", sys.executable)),
    "libdirs": [d for d in (v("LIBDIR"), v("LIBPL"), sys.base_prefix + "/lib") if d],
    "soname": v("INSTSONAME") or "libpython%d.%d.so.1.0" % sys.version_info[:2],
    "site_packages": [p for p in sys.path if p.endswith(("site-packages", "dist-packages"))],
    "numpy": numpy,
}))
"""


@functools.cache
def python_info(python: str = sys.executable) -> dict:
    """Version, libpython directory, site-packages and numpy version of ``python`` (asked by running it)."""
    out = subprocess.run(
        [python, "-c", _QUERY], check=True, capture_output=True, text=True
    ).stdout
    info = json.loads(out)
    soname = info["soname"]
    for d in info["libdirs"] + ["/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib"]:
        if (Path(d) / soname).exists():
            info["libpython_dir"] = d
            break
    else:
        raise RuntimeError(
            f"{python} (Python {info['version']}) has no {soname} in {info['libdirs']}: the Python backend "
            "stub needs a shared libpython (Python built with --enable-shared)."
        )
    return info


DEFAULT_LIBRARY_DIRS = ("/lib", "/usr/lib", "/lib64", "/usr/lib64", "/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu",
                        "/lib/aarch64-linux-gnu", "/usr/lib/aarch64-linux-gnu")


def default_library_dir(directory: str) -> bool:
    """Whether the dynamic linker searches ``directory`` without LD_LIBRARY_PATH (its default directories)."""
    return os.path.realpath(directory) in {os.path.realpath(d) for d in DEFAULT_LIBRARY_DIRS}


def free_port() -> int:
    """A TCP port that is free on 127.0.0.1 right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def backend_directory(version: str) -> Path:
    """A --backend-directory whose python/ holds the stub for Python ``version``.

    The default backends/ is used when its stub already matches (setup_tritonserver.sh put $PYTHON's there);
    otherwise run/backends-py<version>/python/ is made with links to the shared files, so that servers for
    different Python versions never overwrite each other's stub.
    """
    stub = SERVER_DIR / "python_backend_stubs" / version / STUB
    if not stub.exists():
        have = sorted(p.name for p in (SERVER_DIR / "python_backend_stubs").glob("3.*"))
        raise FileNotFoundError(
            f"no Python {version} backend stub in {TRITON_HOME} (have: {have}); run "
            f"scripts/setup_tritonserver.sh --stubs {','.join(have + [version])}"
        )
    default = SERVER_DIR / "backends"
    if (default / "python" / STUB).read_bytes() == stub.read_bytes():
        return default
    per_version = RUN_DIR / f"backends-py{version}"
    py = per_version / "python"
    if not (py / STUB).exists():
        py.mkdir(parents=True, exist_ok=True)
        for name in ("libtriton_python.so", "triton_python_backend_utils.py"):
            _link(py / name, default / "python" / name)
        _link(py / STUB, stub)
    return per_version


def _link(path: Path, target: Path) -> None:
    """Make ``path`` a relative symlink to ``target`` (atomically; fine if another process races us)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(os.path.relpath(target, path.parent))
    os.replace(tmp, path)


def stub_env(info: dict) -> Path:
    """A venv (bin/python3, pyvenv.cfg, a .pth file) for the stub's interpreter to start in; see the module doc."""
    tag = f"py{info['version']}-{hashlib.sha1(info['base_executable'].encode()).hexdigest()[:8]}"
    venv = RUN_DIR / f"stubenv-{tag}"
    site_dir = venv / "lib" / f"python{info['version']}" / "site-packages"
    if not (site_dir / "_triton_stub_pythonpath.pth").exists():
        (venv / "bin").mkdir(parents=True, exist_ok=True)
        site_dir.mkdir(parents=True, exist_ok=True)
        exe = Path(info["base_executable"])
        (venv / "pyvenv.cfg").write_text(
            f"home = {exe.parent}\ninclude-system-site-packages = false\nversion = {info['full_version']}\n"
        )
        for name in ("python", "python3", f"python{info['version']}"):
            _link(venv / "bin" / name, exe)
        (site_dir / "_triton_stub_pythonpath.py").write_text(_PYTHONPATH_MODULE)
        (site_dir / "_triton_stub_pythonpath.pth").write_text(
            "import _triton_stub_pythonpath\n"
        )
    return venv


def numpy_overlay(info: dict) -> list[str]:
    """[stub_site/3.X] when ``python`` has numpy >= 2 (the stub garbles tensors then), else []."""
    if not info["numpy"] or int(info["numpy"].split(".")[0]) < 2:
        return []
    site = TRITON_HOME / "stub_site" / info["version"]
    if not (site / "numpy" / "__init__.py").exists():
        raise FileNotFoundError(
            f"numpy {info['numpy']} garbles tensors in the Triton 2.51 Python backend and {site} has no numpy 1.26: "
            f"run scripts/setup_tritonserver.sh --stubs {info['version']}"
        )
    return [str(site)]


def server_command(
    model_repository: str,
    http_port: int,
    grpc_port: int,
    metrics_port: int,
    python: str = sys.executable,
    log_verbose: int = 0,
    extra_args: list[str] | tuple[str, ...] = (),
) -> tuple[list[str], dict[str, str]]:
    """argv and the full environment that run tritonserver with model.py executed by ``python``'s version."""
    server = SERVER_DIR / "bin" / "tritonserver"
    if not server.exists():
        raise FileNotFoundError(
            f"{server} is missing: run scripts/setup_tritonserver.sh"
        )
    info = python_info(python)
    env = dict(os.environ)

    def join(first: list[str], var: str) -> str:
        return ":".join(
            dict.fromkeys(first + [p for p in env.get(var, "").split(":") if p])
        )

    # The libpython directory only where the dynamic linker would not find it by itself, and after what the
    # environment already names: a system directory (Debian/Ubuntu's /usr/lib/x86_64-linux-gnu) placed first in
    # LD_LIBRARY_PATH outranks the RUNPATHs of torch's CUDA libraries, so a system copy of a library they load by
    # name (cuDNN's engines, NVRTC) replaces theirs; on the H200 image the stub's cuDNN attention was then not
    # used (SDPA fell back to its math kernels: twice the kernels per step, Triton / in-process 0.56).
    extra = [] if default_library_dir(info["libpython_dir"]) else [info["libpython_dir"]]
    env["LD_LIBRARY_PATH"] = ":".join(dict.fromkeys(
        [str(LIBS_DIR)] + [p for p in env.get("LD_LIBRARY_PATH", "").split(":") if p] + extra))
    env["PYTHONPATH"] = join(
        numpy_overlay(info) + [str(REPO_ROOT)] + info["site_packages"], "PYTHONPATH"
    )
    env["PATH"] = join([str(stub_env(info) / "bin")], "PATH")
    argv = [
        str(server),
        f"--model-repository={Path(model_repository).resolve()}",
        f"--backend-directory={backend_directory(info['version'])}",
        f"--http-port={http_port}",
        f"--grpc-port={grpc_port}",
        f"--metrics-port={metrics_port}",
        f"--log-verbose={log_verbose}",
        *extra_args,
    ]
    return argv, env


def shell_line(argv: list[str], env: dict[str, str]) -> str:
    """A copy-pasteable shell line: the variables server_command sets, then argv."""
    pre = " ".join(
        f"{k}={shlex.quote(env[k])}" for k in ("PATH", "LD_LIBRARY_PATH", "PYTHONPATH")
    )
    return f"{pre} {shlex.join(argv)}"


class TritonServer:
    """tritonserver as a child process; a context manager that starts it and waits until it is ready.

    Ports left as None are picked with free_port(). The server's output goes to ``log_path``.
    ``exit_timeout_s`` is the server's --exit-timeout-secs: on SIGTERM it waits that long for in-flight
    requests and open client connections (close tritonclient clients before stop(), or each stop takes that
    long). Its Python-backend shared memory gets a prefix of its own, removed from /dev/shm after it exits
    (a server killed with SIGKILL leaves its 1 MB+ regions behind otherwise).
    """

    def __init__(
        self,
        model_repository: str,
        http_port: int | None = None,
        grpc_port: int | None = None,
        metrics_port: int | None = None,
        python: str = sys.executable,
        log_verbose: int = 0,
        extra_args: list[str] | tuple[str, ...] = (),
        log_path: str | None = None,
        exit_timeout_s: int = 10,
    ):
        self.model_repository = model_repository
        ports = [http_port, grpc_port, metrics_port]
        for i, port in enumerate(ports):
            while port is None or port in ports[:i]:  # three distinct ports
                port = free_port()
            ports[i] = port
        self.http_port, self.grpc_port, self.metrics_port = ports
        self.python = python
        self.log_verbose = log_verbose
        self.exit_timeout_s = exit_timeout_s
        self.shm_prefix = f"triton_py_{os.getpid()}_{self.http_port}_"
        self.extra_args = [
            f"--exit-timeout-secs={exit_timeout_s}",
            f"--backend-config=python,shm-region-prefix-name={self.shm_prefix}",
            *extra_args,
        ]
        if log_path is None:
            fd, log_path = tempfile.mkstemp(prefix="tritonserver-", suffix=".log")
            os.close(fd)
        self.log_path = log_path
        self.process: subprocess.Popen | None = None

    http_url = property(
        lambda self: f"127.0.0.1:{self.http_port}"
    )  # tritonclient.http's url
    grpc_url = property(
        lambda self: f"127.0.0.1:{self.grpc_port}"
    )  # tritonclient.grpc's url
    metrics_url = property(lambda self: f"http://127.0.0.1:{self.metrics_port}/metrics")

    def start(self) -> Self:
        argv, env = server_command(
            self.model_repository,
            self.http_port,
            self.grpc_port,
            self.metrics_port,
            self.python,
            self.log_verbose,
            self.extra_args,
        )
        with open(self.log_path, "ab") as log:
            log.write(f"$ {shell_line(argv, env)}\n".encode())
            log.flush()
            # Own process group: stop() can also kill the stub processes if the server hangs.
            self.process = subprocess.Popen(
                argv,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        atexit.register(self.stop)
        return self

    def log_tail(self, lines: int = 60) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(f.readlines()[-lines:])
        except OSError:
            return ""

    def is_ready(self) -> bool:
        """/v2/health/ready answers 200 and the metrics endpoint answers too (it can come up a moment after HTTP:
        a test reading a gauge right after start-up found it refusing connections)."""
        try:
            with _NO_PROXY.open(f"http://{self.http_url}/v2/health/ready", timeout=2) as r:
                if r.status != 200:
                    return False
            with _NO_PROXY.open(self.metrics_url, timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def wait_ready(self, timeout_s: float | None = None) -> Self:
        """Poll until is_ready(); raise with the log's tail if the server exits or time runs out (timeout_s: default
        TRITON_READY_TIMEOUT_S from the environment, else 120: a fresh GPU machine's warm-up compiles and captures
        ~280 programs with cold caches)."""
        if self.process is None:
            raise RuntimeError("start() first")
        if timeout_s is None:
            timeout_s = float(os.environ.get("TRITON_READY_TIMEOUT_S", "120"))
        deadline = time.monotonic() + timeout_s
        while not self.is_ready():
            rc = self.process.poll()
            if rc is not None:
                raise RuntimeError(
                    f"tritonserver exited with {rc}; {self.log_path}:\n{self.log_tail()}"
                )
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"tritonserver not ready after {timeout_s}s; {self.log_path}:\n{self.log_tail()}"
                )
            time.sleep(0.25)
        return self

    def stop(self, timeout_s: float | None = None) -> int | None:
        """SIGTERM, then SIGKILL to the whole process group after ``timeout_s`` (default: exit_timeout_s + 20).

        Returns the server's exit status (None if it was never started).
        """
        atexit.unregister(self.stop)
        p = self.process
        if p is None:
            return None
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(self.exit_timeout_s + 20 if timeout_s is None else timeout_s)
            except subprocess.TimeoutExpired:
                pass
        try:  # the server, and any stub it left behind
            os.killpg(p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        rc = p.wait()
        for leftover in Path("/dev/shm").glob(f"{self.shm_prefix}*"):
            leftover.unlink(missing_ok=True)
        return rc

    def __enter__(self) -> Self:
        self.start()
        try:
            return self.wait_ready()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name, help_ in (
        ("serve", "run tritonserver in the foreground (exec)"),
        ("command", "print the command"),
    ):
        p = sub.add_parser(name, help=help_)
        p.add_argument("--model-repository", required=True)
        p.add_argument("--http-port", type=int, default=8000)
        p.add_argument("--grpc-port", type=int, default=8001)
        p.add_argument("--metrics-port", type=int, default=8002)
        p.add_argument(
            "--python",
            default=sys.executable,
            help="interpreter whose version/packages run model.py",
        )
        p.add_argument("--log-verbose", type=int, default=0)
        p.add_argument("extra", nargs="*", help="more tritonserver arguments, after --")
    args = ap.parse_args(argv)
    cmd, env = server_command(
        args.model_repository,
        args.http_port,
        args.grpc_port,
        args.metrics_port,
        args.python,
        args.log_verbose,
        args.extra,
    )
    print(shell_line(cmd, env), flush=True)
    if args.cmd == "serve":
        os.execve(cmd[0], cmd, env)
    return 0


if __name__ == "__main__":
    sys.exit(main())
