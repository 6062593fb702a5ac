#!/usr/bin/env python3
"""Start-up check: fail fast, one line per problem, before tritonserver starts (systemd ExecStartPre, docker entrypoint).

    python scripts/check_deployment.py [--model-repository model_repository] [--requirements requirements/cpu.txt]
                                       [--triton-root DIR] [--skip-server]

Checks what will actually be served: the paths and device named by the model repository's config.pbtxt files
(target config.json / safetensors / tokenizer.json, drafter config.json + every shard its index names,
tokenizer_path of pre/postprocessing, cost_model_path), the engine parameters (ddtree.config.EngineConfig), the
Python packages of the requirement files (installed, in the pinned range) for this interpreter, the tritonserver
binary and Python backend (bare metal: scripts/setup_tritonserver.sh's .deps/tritonserver; the NGC image:
/opt/tritonserver), and a usable GPU when the config asks for cuda. Exit status 0 when all is well, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
PARAM = re.compile(r'key:\s*"([^"]+)"\s*,?\s*value:\s*\{\s*string_value:\s*"([^"]*)"')  # parameters { key value }


def read_pbtxt(path: Path) -> tuple[str, dict[str, str]]:
    """(text without comments, {parameter: string_value}) of a Triton config.pbtxt."""
    text = re.sub(r'(?m)^\s*#.*$|\s#[^"\n]*$', "", path.read_text())
    return text, dict(PARAM.findall(text))


def check_safetensors(file: Path) -> str | None:
    """None if ``file`` is a complete safetensors file (header and data sizes add up), else the problem."""
    if not file.is_file():
        return "missing"
    if not os.access(file, os.R_OK):
        return "not readable by this user"
    size = file.stat().st_size
    try:
        with file.open("rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if 8 + n > size:
                return f"truncated ({size} bytes, shorter than its header)"
            header = json.loads(f.read(n))
        end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return "not a safetensors file"
    return None if 8 + n + end == size else f"truncated ({size} bytes, header says {8 + n + end})"


def check_checkpoint(kind: str, path: Path, problems: list[str], tokenizer: bool = False) -> None:
    if not path.is_dir():
        problems.append(f"{kind} directory missing: {path}")
        return
    config = path / "config.json"
    try:
        json.loads(config.read_text())
    except (OSError, ValueError) as e:
        problems.append(f"{kind} config.json missing or invalid: {config} ({e.__class__.__name__})")
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError) as e:
            problems.append(f"{kind} shard index invalid: {index} ({e.__class__.__name__})")
            shards = []
        files = [path / s for s in shards]
    else:
        files = sorted(path.glob("*.safetensors"))
        if not files:
            problems.append(f"{kind} weights missing: no *.safetensors in {path}")
    for file in files:
        if (problem := check_safetensors(file)) is not None:
            problems.append(f"{kind} weights {problem}: {file}")
    if tokenizer:
        check_tokenizer(kind, path, problems)


def check_tokenizer(kind: str, path: Path, problems: list[str]) -> None:
    if not (path / "tokenizer.json").is_file():
        problems.append(f"{kind} tokenizer.json missing: {path / 'tokenizer.json'}")


def check_model_repository(repo: Path, problems: list[str]) -> str | None:
    """Model files named by the repository; returns the engine's device ("cpu", "cuda:1", ...)."""
    base = repo.resolve().parent  # relative paths are relative to the directory holding the repository
    ddtree_config = repo / "ddtree" / "config.pbtxt"
    if not ddtree_config.is_file():
        problems.append(f"model repository has no ddtree/config.pbtxt: {repo}")
        return None
    for config in sorted(repo.glob("*/config.pbtxt")):
        text, params = read_pbtxt(config)
        if re.search(r'backend:\s*"python"', text) and not list(config.parent.glob("[0-9]*/model.py")):
            problems.append(f"python model without <version>/model.py: {config.parent}")
        if "tokenizer_path" in params:
            check_tokenizer(f"{config.parent.name} tokenizer_path", base / params["tokenizer_path"], problems)
    try:
        from ddtree.config import EngineConfig
    except ImportError as e:
        problems.append(f"engine package ddtree does not import: {e}")
        return None
    try:
        engine = EngineConfig.from_dict(read_pbtxt(ddtree_config)[1], base_dir=base)
    except (ValueError, TypeError) as e:
        problems.append(f"bad engine parameter in {ddtree_config}: {e}")
        return None
    check_checkpoint("target", Path(engine.target_path), problems, tokenizer=True)
    if engine.drafter_path:
        check_checkpoint("drafter", Path(engine.drafter_path), problems)
    if engine.cost_model_path and not Path(engine.cost_model_path).is_file():
        problems.append(f"cost_model_path missing: {engine.cost_model_path}")
    return engine.device


def requirement_lines(file: Path, seen: set[Path]) -> list[tuple[Path, str]]:
    """(file, requirement) for every requirement of ``file`` and the files it includes with -r."""
    if file in seen:
        return []
    seen.add(file)
    out = []
    for line in file.read_text().splitlines():
        line = re.sub(r"(^|\s)#.*", "", line).strip()
        if line.startswith(("-r ", "--requirement ")):
            out += requirement_lines((file.parent / line.split(None, 1)[1]).resolve(), seen)
        elif line and not line.startswith("-"):
            out.append((file, line))
    return out


def check_packages(files: list[Path], problems: list[str]) -> None:
    from importlib import metadata

    try:
        from packaging.requirements import Requirement
    except ImportError:
        problems.append("python package missing: packaging (needed to read the requirement files)")
        return
    seen: set[Path] = set()
    for file in files:
        if not file.is_file():
            problems.append(f"requirement file missing: {file}")
            continue
        for source, line in requirement_lines(file.resolve(), seen):
            req = Requirement(line)
            if req.marker is not None and not req.marker.evaluate():
                continue
            where = source.relative_to(ROOT) if source.is_relative_to(ROOT) else source
            try:
                version = metadata.version(req.name)
            except metadata.PackageNotFoundError:
                problems.append(f"python package missing: {req} (from {where}; pip install -r {where})")
                continue
            if not req.specifier.contains(version, prereleases=True):
                problems.append(f"python package {req.name} {version} does not satisfy {req} (from {where})")


def find_triton(root: str | None) -> tuple[Path | None, dict[str, str]]:
    """The tritonserver install directory (bin/, backends/) and the environment its binary needs."""
    home = Path(os.environ.get("TRITON_HOME", ROOT / ".deps" / "tritonserver"))
    if root:
        server_dir = Path(root)
    elif (home / "pytriton" / "tritonserver" / "bin" / "tritonserver").exists():  # scripts/setup_tritonserver.sh
        server_dir = home / "pytriton" / "tritonserver"
    elif Path("/opt/tritonserver/bin/tritonserver").exists():  # NGC tritonserver image
        server_dir = Path("/opt/tritonserver")
    else:
        return None, {}
    env = dict(os.environ)
    libs = server_dir.parent.parent / "nvidia_pytriton.libs"  # the wheel's layout needs its bundled libraries
    if libs.is_dir():
        env["LD_LIBRARY_PATH"] = ":".join(p for p in (str(libs), env.get("LD_LIBRARY_PATH")) if p)
    return server_dir, env


def check_server(root_arg: str | None, problems: list[str]) -> None:
    root, env = find_triton(root_arg)
    if root is None:
        problems.append("tritonserver not found: run scripts/setup_tritonserver.sh (bare metal), or use the NGC image "
                        "(docker/Dockerfile), or pass --triton-root")
        return
    server = root / "bin" / "tritonserver"
    backend = root / "backends" / "python"
    for path in (server, backend / "libtriton_python.so", backend / "triton_python_backend_stub"):
        if not path.is_file():
            problems.append(f"tritonserver file missing: {path} (run scripts/setup_tritonserver.sh --force)")
    version = "%d.%d" % sys.version_info[:2]
    stubs = root / "python_backend_stubs"
    if stubs.is_dir() and not (stubs / version / "triton_python_backend_stub").is_file():
        problems.append(f"no Python {version} backend stub in {stubs}: run scripts/setup_tritonserver.sh --stubs {version}")
    try:
        from importlib.metadata import version as package_version

        numpy2 = int(package_version("numpy").split(".")[0]) >= 2
    except Exception:
        numpy2 = False
    overlay = root.parent.parent / "stub_site" / version / "numpy" / "__init__.py"
    if stubs.is_dir() and numpy2 and not overlay.is_file():  # the 2.51 stub garbles tensors under numpy 2
        problems.append(f"numpy 1.26 overlay for the Python backend missing: {overlay.parent} "
                        f"(run scripts/setup_tritonserver.sh --stubs {version})")
    if server.is_file():
        try:
            out = subprocess.run([str(server), "--help"], env=env, capture_output=True, text=True, timeout=30)
            usage = out.stdout + out.stderr
        except (OSError, subprocess.TimeoutExpired) as e:
            usage = str(e)
        if "Usage: tritonserver" not in usage:
            first = (usage.strip().splitlines() or ["no output"])[0]
            problems.append(f"tritonserver does not start: {server}: {first}")


def check_gpu(device: str, problems: list[str]) -> None:
    try:
        import torch
    except Exception as e:  # the package check names a missing torch already
        problems.append(f"config asks for device {device!r} but torch does not import: {e}")
        return
    if torch.version.cuda is None or not torch.cuda.is_available():
        problems.append(f"config asks for device {device!r} but torch {torch.__version__} sees no CUDA GPU "
                        f"(CUDA build: {torch.version.cuda}; driver, CUDA_VISIBLE_DEVICES, container --gpus?)")
        return
    index = int(device.split(":")[1]) if ":" in device else 0
    if index >= torch.cuda.device_count():
        problems.append(f"config asks for device {device!r} but only {torch.cuda.device_count()} GPU(s) are visible")
        return
    major, minor = torch.cuda.get_device_capability(index)
    arches = torch.cuda.get_arch_list()
    if f"sm_{major}{minor}" not in arches and not any(a.startswith("compute_") and int(a[8:]) <= major * 10 + minor
                                                      for a in arches):
        problems.append(f"torch {torch.__version__} has no kernels for {torch.cuda.get_device_name(index)} "
                        f"(sm_{major}{minor}; built for {arches}): install a build for CUDA >= 12.8")
    check_cudnn(torch, problems)


def check_cudnn(torch, problems: list[str]) -> None:
    """torch's own cuDNN loads: an older system cuDNN earlier in LD_LIBRARY_PATH replaces it, and then attention
    silently runs SDPA's math fallback (twice the kernels per decode step; seen on an H200 image whose
    /usr/lib/x86_64-linux-gnu held cuDNN 9.14 under torch's 9.19)."""
    try:
        ok = torch.backends.cudnn.is_available() and torch.backends.cudnn.version() is not None
    except RuntimeError as e:
        problems.append(f"torch's cuDNN does not load: {e} (LD_LIBRARY_PATH={os.environ.get('LD_LIBRARY_PATH', '')!r}: "
                        "drop the directory holding the other cuDNN from it, or put torch's own first)")
        return
    if not ok:
        problems.append("torch sees no cuDNN: attention runs SDPA's math fallback (check LD_LIBRARY_PATH and the "
                        "nvidia-cudnn package)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-repository", default=str(ROOT / "model_repository"))
    ap.add_argument("--requirements", nargs="+", default=[str(ROOT / "requirements" / "cpu.txt")],
                    help="requirement files the serving interpreter must satisfy")
    ap.add_argument("--triton-root", help="tritonserver install directory (with bin/ and backends/)")
    ap.add_argument("--skip-server", action="store_true", help="do not look for the tritonserver binary")
    args = ap.parse_args(argv)

    problems: list[str] = []
    repo = Path(args.model_repository)
    device = None
    if repo.is_dir():
        device = check_model_repository(repo, problems)
    else:
        problems.append(f"model repository missing: {repo}")
    check_packages([Path(f) for f in args.requirements], problems)
    if not args.skip_server:
        check_server(args.triton_root, problems)
    if device and device.startswith("cuda"):
        check_gpu(device, problems)
    for problem in problems:
        print(f"check_deployment: FAIL: {problem}", file=sys.stderr)
    if problems:
        print(f"check_deployment: {len(problems)} problem(s); not starting", file=sys.stderr)
        return 1
    print(f"check_deployment: ok ({repo}, device {device}, Python {sys.version.split()[0]})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
