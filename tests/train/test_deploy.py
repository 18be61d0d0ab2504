"""deploy/ against the code it deploys, checked statically: no Docker, no Kubernetes, no Ray
started, no network.

The image (deploy/Dockerfile), the KubeRay manifests (deploy/kuberay/), the `ray up` config
(deploy/cluster.yaml) and the commands in deploy/README.md are read as data. Every command that
they run goes through the parser that will run it: `kaisa-ray ...` through the project's own
click group (`train` and `serve` with --dry-run, so that the job file, the storage and the
service's environment-configured settings are validated too), `ray ...` through Ray's own click
CLI (parsed, never invoked), so that a renamed or misspelt flag fails here and not on a cluster.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import click
import jsonschema
import pytest
import ray
import yaml
from click.testing import CliRunner, Result

import service.cli  # registers serve, submit, jobs and cancel on the group
from kaisa_train.datasets import DEFAULT_FASHION_MNIST_DIR
from kaisa_train.spec import KFACSpec, load_job_spec
from kaisa_train.storage import is_uri, resolve_storage

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
KUBERAY = DEPLOY / "kuberay"
GPU_EXAMPLE = ROOT / "examples" / "fashion_mnist_gpu.yaml"
CLUSTER = "kaisa-ray"  # the RayCluster's name; KubeRay's head service is <name>-head-svc

# Importing Ray's CLI imports Ray Serve, whose models use a pydantic v1 idiom.
pytestmark = pytest.mark.filterwarnings("ignore:Using extra keyword arguments on `Field`")

# A token KubeRay would read from a Secret, or a shell variable in the README: a stand-in.
SECRET = "stand-in-secret"


def yaml_docs(path: Path) -> list[Any]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


@cache
def kuberay_objects() -> dict[tuple[str, str], dict[str, Any]]:
    """Every object in deploy/kuberay/, by (kind, name)."""
    objects = {}
    for path in sorted(KUBERAY.glob("*.yaml")):
        for doc in yaml_docs(path):
            objects[(doc["kind"], doc["metadata"]["name"])] = doc
    return objects


def ray_cluster() -> dict[str, Any]:
    return kuberay_objects()[("RayCluster", CLUSTER)]


def service_deployment() -> dict[str, Any]:
    return kuberay_objects()[("Deployment", "kaisa-ray-service")]


def ray_pod_templates() -> list[dict[str, Any]]:
    """The pod templates of the RayCluster: the head's, then each worker group's."""
    spec = ray_cluster()["spec"]
    return [spec["headGroupSpec"]["template"]] + [g["template"] for g in spec["workerGroupSpecs"]]


def env_of(container: dict[str, Any]) -> dict[str, str]:
    """A container's environment as the process sees it (Secrets as a stand-in value)."""
    env = {}
    for var in container.get("env", []):
        env[var["name"]] = var.get("value", SECRET)
    return env


def launcher_config() -> dict[str, Any]:
    (config,) = yaml_docs(DEPLOY / "cluster.yaml")
    assert isinstance(config, dict)
    return config


def launcher_env() -> dict[str, str]:
    """The variables `docker run --env` gives every container of the `ray up` cluster."""
    env = {}
    for option in launcher_config()["docker"]["run_options"]:
        words = shlex.split(option)
        if words[0] in ("--env", "-e"):
            name, _, value = words[1].partition("=")
            env[name] = value
    return env


def cpu_quantity(value: str | int | float) -> float:
    text = str(value)
    return float(text[:-1]) / 1000 if text.endswith("m") else float(text)


# --- the Dockerfile -------------------------------------------------------------------------


@dataclass(frozen=True)
class Instruction:
    keyword: str
    args: str
    stage: str


@cache
def dockerfile() -> tuple[Instruction, ...]:
    """The Dockerfile's instructions (continuations joined), each with its build stage."""
    text = re.sub(r"\\\n", " ", (DEPLOY / "Dockerfile").read_text())
    instructions, stage = [], ""
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        keyword, _, args = line.partition(" ")
        if keyword.upper() == "FROM":
            words = args.split()
            stage = words[2] if len(words) == 3 and words[1].upper() == "AS" else words[0]
        instructions.append(Instruction(keyword.upper(), args.strip(), stage))
    return tuple(instructions)


def build_args() -> dict[str, str]:
    return dict(i.args.split("=", 1) for i in dockerfile() if i.keyword == "ARG" and "=" in i.args)


@dataclass(frozen=True)
class Copy:
    flags: dict[str, str]
    sources: tuple[str, ...]
    dest: str


def copies() -> list[Copy]:
    found = []
    for instruction in dockerfile():
        if instruction.keyword != "COPY":
            continue
        words = shlex.split(instruction.args)
        flags = dict(w[2:].partition("=")[::2] for w in words if w.startswith("--"))
        paths = [w for w in words if not w.startswith("--")]
        found.append(Copy(flags, tuple(paths[:-1]), paths[-1]))
    return found


@cache
def image_paths() -> dict[str, Path]:
    """Where the repository's files land in the image: image path -> repository path."""
    mapping = {}
    for copy in copies():
        if "from" in copy.flags:
            continue
        for source in copy.sources:
            dest = copy.dest + Path(source).name if copy.dest.endswith("/") else copy.dest
            mapping[dest.rstrip("/")] = ROOT / source
    return mapping


def repo_path(image_path: str) -> Path | None:
    """The repository file behind a path in the image, if the Dockerfile copies one there."""
    for dest, source in sorted(image_paths().items(), key=lambda item: -len(item[0])):
        if image_path == dest or image_path.startswith(dest + "/"):
            return source / image_path[len(dest) :].lstrip("/")
    return None


def _glob(pattern: str) -> re.Pattern[str]:
    parts = re.split(r"(\*\*/|\*\*|\*|\?)", pattern.strip("/"))
    wild = {"**/": "(?:.*/)?", "**": ".*", "*": "[^/]*", "?": "[^/]"}
    return re.compile("".join(wild.get(part, re.escape(part)) for part in parts))


def ignored_by_docker(relative: str) -> bool:
    """Whether deploy/Dockerfile.dockerignore keeps a path out of the build context: the last
    pattern that matches the path or one of its parent folders decides (`!` lets it in)."""
    patterns = [
        line.strip()
        for line in (DEPLOY / "Dockerfile.dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    parts = relative.split("/")
    candidates = ["/".join(parts[:n]) for n in range(1, len(parts) + 1)]
    verdict = False
    for pattern in patterns:
        negated = pattern.startswith("!")
        regex = _glob(pattern.lstrip("!"))
        if any(regex.fullmatch(candidate) for candidate in candidates):
            verdict = not negated
    return verdict


def run_entrypoint(args: list[str], stubs: Path) -> list[str]:
    """What the image's entrypoint script runs for `docker run IMAGE ARGS`: the script itself,
    with `kaisa-ray` and `ray` stand-ins on the PATH that print the argv they got."""
    stubs.mkdir(exist_ok=True)
    for program in ("kaisa-ray", "ray"):
        stub = stubs / program
        stub.write_text(f"#!/bin/sh\nprintf '%s\\n' {program} \"$@\"\n")
        stub.chmod(0o755)
    completed = subprocess.run(
        ["sh", str(DEPLOY / "docker-entrypoint.sh"), *args],
        env={"PATH": f"{stubs}:/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert completed.returncode == 0, completed.stderr
    return completed.stdout.splitlines()


# --- commands, wherever they are written -----------------------------------------------------


@dataclass(frozen=True)
class Invocation:
    """One `kaisa-ray ...` or `ray ...` command that a file in deploy/ runs or tells to run."""

    source: str
    program: str  # "kaisa-ray" or "ray"
    args: tuple[str, ...]
    env: tuple[tuple[str, str], ...] = ()
    cwd: str = "."  # where relative paths resolve (a `ray job submit --working-dir`)

    @property
    def id(self) -> str:
        return f"{self.source}: {self.program} {' '.join(self.args)}"[:120]


SHELL_SEPARATORS = {";", "&&", "||", "|", "&"}
SHELL_VARIABLE = re.compile(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?")


def shell_commands(script: str, variables: dict[str, str] | None = None) -> Iterator[list[str]]:
    """The simple commands of a shell script, as argv lists: variables replaced by the given
    values or stand-ins, redirections dropped."""
    values = variables or {}
    script = SHELL_VARIABLE.sub(
        lambda m: values.get(m.group(1), f"{SECRET}-{m.group(1)}"), script.replace("\\\n", " ")
    )
    for line in script.splitlines():
        lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        command: list[str] = []
        redirect = False
        for token in lexer:
            if token in SHELL_SEPARATORS:
                yield command
                command = []
            elif set(token) <= set("<>&") and set(token) & set("<>"):
                redirect = True  # `> file`, `2>&1`: the next word is the target
                if command and command[-1].isdigit():
                    command.pop()
            elif redirect:
                redirect = False
            else:
                command.append(token)
        yield command


def invocations_in(
    argv: list[str], source: str, env: dict[str, str], cwd: str = "."
) -> Iterator[Invocation]:
    """The kaisa-ray and ray commands in one argv, and those it runs (a `ray job submit`'s
    entrypoint, a `ray exec`'s command, what follows a `--`)."""
    env = dict(env)
    while argv and (argv[0] in ("exec", "nohup") or re.fullmatch(r"\w+=.*", argv[0])):
        if "=" in argv[0]:
            name, _, value = argv[0].partition("=")
            env[name] = value
        argv = argv[1:]
    if not argv:
        return
    program = Path(argv[0]).name
    if program == "kaisa-ray":
        yield Invocation(source, program, tuple(argv[1:]), tuple(sorted(env.items())), cwd)
    elif program == "ray":
        yield Invocation(source, program, tuple(argv[1:]), tuple(sorted(env.items())), cwd)
        if argv[1:3] == ["job", "submit"] and "--" in argv:
            working_dir = next(
                (a.split("=", 1)[1] for a in argv if a.startswith("--working-dir=")),
                argv[argv.index("--working-dir") + 1] if "--working-dir" in argv else ".",
            )
            rest = argv[argv.index("--") + 1 :]
            yield from invocations_in(rest, source, {}, working_dir)
        elif argv[1:2] == ["exec"]:
            # The command comes last (ray's own parse of the exec checks that it is its CMD);
            # it runs in the cluster's containers, with their environment.
            config_env = launcher_env() if "deploy/cluster.yaml" in argv else {}
            for inner in shell_commands(argv[-1]):
                yield from invocations_in(inner, source, config_env)
    elif argv[:2] == ["docker", "run"] and the_image() in argv:
        # `docker run [options] IMAGE ARGS`: what the image's entrypoint makes of ARGS.
        flags = argv[2 : argv.index(the_image())]
        for n, flag in enumerate(flags[:-1]):
            if flag in ("-e", "--env"):
                name, _, value = flags[n + 1].partition("=")
                env[name] = value or SECRET
        with tempfile.TemporaryDirectory() as stubs:
            argv = run_entrypoint(argv[argv.index(the_image()) + 1 :], Path(stubs))
        yield from invocations_in(argv, source, env, cwd)
    elif "--" in argv:
        yield from invocations_in(argv[argv.index("--") + 1 :], source, env, cwd)


def kuberay_start_args(params: dict[str, str], head: bool, limits: dict[str, Any]) -> list[str]:
    """`ray start` as KubeRay builds it from rayStartParams (its convertParamMap: "true" is a
    bare flag, "false" is dropped, but for the options that take a boolean value)."""
    params = dict(params)
    gpus = [v for k, v in limits.items() if k.endswith("gpu") and int(v) > 0]
    if gpus and "num-gpus" not in params:
        params["num-gpus"] = str(gpus[0])
    args = ["start", "--head"] if head else ["start", f"--address={CLUSTER}-head-svc:6379"]
    args.append("--block")
    takes_boolean = {"log-color", "include-dashboard", "include-log-monitor"}
    for option in sorted(params):
        value = str(params[option])
        if value.lower() in ("true", "false") and option not in takes_boolean:
            if value.lower() == "true":
                args.append(f"--{option}")
        else:
            args.append(f"--{option}={value}")
    return args


def the_image() -> str:
    """The image the service's Deployment runs (test_one_image_everywhere: all of them)."""
    image: str = service_deployment()["spec"]["template"]["spec"]["containers"][0]["image"]
    return image


def readme_code() -> list[str]:
    text = (DEPLOY / "README.md").read_text()
    return re.findall(r"```(?:bash|sh|shell|console)?\n(.*?)```", text, flags=re.DOTALL)


def readme_variables() -> dict[str, str]:
    """The shell variables deploy/README.md sets to a literal (`BUCKET=my-kaisa-ray-bucket`)."""
    assignment = re.compile(r"^\s*(?:export\s+)?([A-Za-z_]\w*)=([^\s$\"'`]+)\s*$", re.MULTILINE)
    return {name: value for block in readme_code() for name, value in assignment.findall(block)}


@cache
def all_invocations() -> tuple[Invocation, ...]:
    found: list[Invocation] = []

    # The RayCluster: KubeRay's `ray start` from each group's rayStartParams.
    spec = ray_cluster()["spec"]
    groups = [(spec["headGroupSpec"], True)] + [(g, False) for g in spec["workerGroupSpecs"]]
    for group, head in groups:
        container = group["template"]["spec"]["containers"][0]
        limits = container.get("resources", {}).get("limits", {})
        args = kuberay_start_args(group.get("rayStartParams", {}), head, limits)
        found.append(Invocation("raycluster.yaml", "ray", tuple(args)))

    # The service's Deployment: its container's command.
    container = service_deployment()["spec"]["template"]["spec"]["containers"][0]
    argv = container.get("command", []) + container.get("args", [])
    scripts = [argv[-1]] if argv[:2] == ["/bin/bash", "-c"] else [shlex.join(argv)]
    for script in scripts:
        for command in shell_commands(script):
            found += invocations_in(command, "service.yaml", env_of(container))

    # The RayJob's entrypoint: a driver on the head, with the head's environment.
    job = kuberay_objects()[("RayJob", "fashion-mnist-gpu")]
    head_env = env_of(spec["headGroupSpec"]["template"]["spec"]["containers"][0])
    for command in shell_commands(job["spec"]["entrypoint"]):
        found += invocations_in(command, "rayjob.yaml", head_env)

    # The image's ENTRYPOINT and CMD, through the entrypoint script.
    (entrypoint,) = [json.loads(i.args) for i in dockerfile() if i.keyword == "ENTRYPOINT"]
    (cmd,) = [json.loads(i.args) for i in dockerfile() if i.keyword == "CMD"]
    assert repo_path(entrypoint[0]) == DEPLOY / "docker-entrypoint.sh", entrypoint
    with tempfile.TemporaryDirectory() as stubs:
        argv = run_entrypoint([*entrypoint[1:], *cmd], Path(stubs))
    found += invocations_in(argv, "Dockerfile", {})

    # The `ray up` config: every command list it runs on the nodes.
    config = launcher_config()
    lists = [k for k in config if k.endswith("_commands")]
    for key in lists:
        for script in config[key]:
            for command in shell_commands(script):
                found += invocations_in(command, f"cluster.yaml {key}", launcher_env())

    # deploy/README.md: every shell code block.
    for block in readme_code():
        for command in shell_commands(block, readme_variables()):
            found += invocations_in(command, "README.md", {})
    return tuple(found)


def run_kaisa_ray(invocation: Invocation, monkeypatch: pytest.MonkeyPatch) -> Result:
    """Run a kaisa-ray command through the project's click group, safely: `train` and `serve`
    with --dry-run, `validate` as is, anything else (a client of a running service) with
    --help, which parses every option without acting. Paths in the image map to the repository."""
    args = []
    for arg in invocation.args:
        mapped = repo_path(arg) if arg.startswith("/") else None
        args.append(str(mapped) if mapped is not None else arg)
    subcommand = next((a for a in args if not a.startswith("-")), None)
    if subcommand in ("train", "serve"):
        args.append("--dry-run")
    elif subcommand not in (None, "validate"):
        args.append("--help")
    # Only what the file sets: nothing from the environment of whoever runs the tests.
    env: dict[str, str | None] = {
        name: None for name in os.environ if name.startswith(("KAISA_RAY_", "RAY_ADDRESS"))
    }
    env.update(dict(invocation.env))
    monkeypatch.chdir(ROOT / invocation.cwd)
    return CliRunner().invoke(service.cli.main, args, env=env)


def ray_command(args: list[str]) -> tuple[click.Command, list[str]]:
    from ray.scripts.scripts import cli

    command: click.Command = cli
    rest = list(args)
    while isinstance(command, click.Group) and rest and rest[0] in command.commands:
        command = command.commands[rest.pop(0)]
    assert not isinstance(command, click.Group), f"`ray {' '.join(args)}`: no such ray command"
    return command, rest


def parse_ray(args: list[str]) -> dict[str, Any]:
    """Parse a ray command line with Ray's own click CLI without running it; an unknown option
    or a bad value raises click's UsageError."""
    command, rest = ray_command(args)
    with command.make_context(f"ray {command.name}", rest) as context:
        return dict(context.params)


def invocation_of(source: str, program: str, first: str) -> Invocation:
    matches = [
        i
        for i in all_invocations()
        if i.source == source and i.program == program and i.args[:1] == (first,)
    ]
    assert len(matches) == 1, (source, program, first, matches)
    return matches[0]


def option(args: tuple[str, ...], name: str) -> str:
    """The value of `--name VALUE` or `--name=VALUE` in an argv."""
    for n, arg in enumerate(args):
        if arg == name:
            return args[n + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    raise AssertionError(f"{name} is not in {args}")


# --- the tests --------------------------------------------------------------------------------


def test_every_yaml_file_in_deploy_parses() -> None:
    files = sorted(DEPLOY.rglob("*.yaml")) + sorted(DEPLOY.rglob("*.yml"))
    assert len(files) >= 5, files
    for path in files:
        docs = yaml_docs(path)
        assert docs, f"{path} holds no document"
        assert all(isinstance(doc, dict) for doc in docs), path


def test_the_kuberay_manifests_have_the_expected_kinds() -> None:
    found = {(doc["apiVersion"], kind, name) for (kind, name), doc in kuberay_objects().items()}
    assert found == {
        ("ray.io/v1", "RayCluster", CLUSTER),
        ("ray.io/v1", "RayJob", "fashion-mnist-gpu"),
        ("apps/v1", "Deployment", "kaisa-ray-service"),
        ("v1", "Service", "kaisa-ray-service"),
        ("v1", "PersistentVolumeClaim", "kaisa-ray-runs"),
        ("v1", "PersistentVolumeClaim", "kaisa-ray-service-data"),
    }


def test_the_head_is_cpu_only_and_the_workers_have_one_gpu_each() -> None:
    spec = ray_cluster()["spec"]
    head = spec["headGroupSpec"]
    assert head["rayStartParams"]["num-gpus"] == "0"
    assert head["rayStartParams"].get("include-dashboard", "true") == "true"
    resources = head["template"]["spec"]["containers"][0]["resources"]
    assert not any("gpu" in key for part in resources.values() for key in part), resources
    (group,) = spec["workerGroupSpecs"]
    assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
    resources = group["template"]["spec"]["containers"][0]["resources"]
    assert resources["limits"]["nvidia.com/gpu"] == "1"
    assert resources["requests"]["nvidia.com/gpu"] == resources["limits"]["nvidia.com/gpu"]


def test_the_gpu_example_fits_the_worker_group_and_the_launcher_nodes() -> None:
    job = load_job_spec(GPU_EXAMPLE)
    assert isinstance(job.kfac, KFACSpec)
    assert job.kfac.strategy == "auto"
    assert job.memory_budget is not None
    assert job.precision == "bf16"
    assert job.scaling.gpus_per_worker == 1
    assert job.max_failures >= 1
    scaling = job.scaling
    (group,) = ray_cluster()["spec"]["workerGroupSpecs"]
    limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
    per_pod = min(
        int(limits["nvidia.com/gpu"]) // scaling.gpus_per_worker,
        cpu_quantity(limits["cpu"]) // scaling.cpus_per_worker,
    )
    assert per_pod >= 1, limits
    assert group["replicas"] * per_pod >= scaling.workers
    if scaling.placement == "strict-spread":
        assert group["replicas"] >= scaling.workers
    gpu_nodes = [
        node
        for node in launcher_config()["available_node_types"].values()
        if node["resources"].get("GPU", 0) > 0
    ]
    (node,) = gpu_nodes
    per_node = min(
        node["resources"]["GPU"] // scaling.gpus_per_worker,
        node["resources"]["CPU"] // scaling.cpus_per_worker,
    )
    assert per_node >= 1
    assert node["min_workers"] * per_node >= scaling.workers


def test_token_authentication_is_wired_for_the_cluster_and_the_service() -> None:
    cluster = ray_cluster()["spec"]
    assert cluster["authOptions"]["mode"] == "token"
    # KubeRay requires rayVersion >= 2.52.0 for token auth; it must also be the image's Ray.
    version = tuple(int(p) for p in cluster["rayVersion"].split("."))
    assert version >= (2, 52, 0)
    assert cluster["rayVersion"] == ray.__version__
    # The Secret KubeRay creates (named after the cluster) or the one authOptions names.
    ray_secret = cluster["authOptions"].get("secretName", CLUSTER)
    container = service_deployment()["spec"]["template"]["spec"]["containers"][0]
    env = {var["name"]: var for var in container["env"]}
    assert env["RAY_AUTH_MODE"]["value"] == "token"
    assert env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"] == {
        "name": ray_secret,
        "key": "auth_token",
    }
    api_token = env["KAISA_RAY_TOKEN"]["valueFrom"]["secretKeyRef"]
    assert api_token["name"] != ray_secret  # the service's own token, not the cluster's
    # Nothing turns authentication off.
    containers = [t["spec"]["containers"][0] for t in ray_pod_templates()] + [container]
    assert all(env_of(c).get("RAY_AUTH_MODE", "token") == "token" for c in containers)
    # The `ray up` cluster: token mode in every container, the token file mounted into each.
    assert launcher_env()["RAY_AUTH_MODE"] == "token"
    assert launcher_config()["file_mounts"]["~/.ray/auth_token"] == "~/.ray/auth_token"


def test_one_image_everywhere_built_on_the_ray_and_python_in_use() -> None:
    images = {c["image"] for t in ray_pod_templates() for c in t["spec"]["containers"]}
    images |= {c["image"] for c in service_deployment()["spec"]["template"]["spec"]["containers"]}
    docker = launcher_config()["docker"]
    images |= {docker[key] for key in ("image", "head_image", "worker_image") if key in docker}
    assert len(images) == 1, images
    (image,) = images
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    name, _, tag = image.rpartition(":")
    assert name.rsplit("/", 1)[-1] == "kaisa-ray"
    assert tag == pyproject["project"]["version"]
    python = f"py{sys.version_info.major}{sys.version_info.minor}"
    assert build_args()["RAY_IMAGE"] == f"rayproject/ray:{ray.__version__}-{python}-gpu"


def test_checkpoints_go_to_storage_every_node_reaches() -> None:
    claims = {
        name: doc
        for (kind, name), doc in kuberay_objects().items()
        if kind == "PersistentVolumeClaim"
    }
    mounts, storages = set(), set()
    for template in ray_pod_templates():
        volumes = {v["name"]: v for v in template["spec"].get("volumes", [])}
        container = template["spec"]["containers"][0]
        shared = [
            (m["mountPath"], volumes[m["name"]]["persistentVolumeClaim"]["claimName"])
            for m in container.get("volumeMounts", [])
            if "persistentVolumeClaim" in volumes.get(m["name"], {})
        ]
        assert len(shared) == 1, shared
        mounts |= set(shared)
        storages.add(env_of(container)["KAISA_RAY_STORAGE"])
    assert len(mounts) == 1, mounts  # one volume, at one path, on the head and the workers
    assert len(storages) == 1, storages
    ((mount_path, claim),) = mounts
    (storage,) = storages
    assert Path(storage).is_relative_to(mount_path)
    assert "ReadWriteMany" in claims[claim]["spec"]["accessModes"]
    # The service passes its storage to every job it runs: the same shared path.
    service_env = env_of(service_deployment()["spec"]["template"]["spec"]["containers"][0])
    assert service_env["KAISA_RAY_STORAGE_PATH"] == storage
    # The `ray up` nodes share no filesystem: object storage, which the code accepts.
    remote = launcher_env()["KAISA_RAY_STORAGE"]
    assert is_uri(remote)
    assert resolve_storage(remote, create=False) == remote


def test_the_service_deployment_reaches_the_head_and_is_probed() -> None:
    deployment = service_deployment()
    spec = deployment["spec"]
    assert spec["replicas"] == 1
    assert spec["strategy"]["type"] == "Recreate"  # SQLite: one writer at a time
    pod = spec["template"]
    container = pod["spec"]["containers"][0]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    env = env_of(container)
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    (data,) = [m for m in container["volumeMounts"] if m["mountPath"] == env["KAISA_RAY_DATA_DIR"]]
    claim = volumes[data["name"]]["persistentVolumeClaim"]["claimName"]
    assert kuberay_objects()[("PersistentVolumeClaim", claim)]["spec"]["accessModes"] == [
        "ReadWriteOnce"
    ]
    (svc,) = [doc for (kind, _), doc in kuberay_objects().items() if kind == "Service"]
    assert svc["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert svc["spec"]["selector"] == spec["selector"]["matchLabels"]
    (svc_port,) = svc["spec"]["ports"]
    assert svc_port["port"] == 8000
    assert svc_port["targetPort"] == "http"

    serve = invocation_of("service.yaml", "kaisa-ray", "serve")
    start = invocation_of("service.yaml", "ray", "start")
    head = f"{CLUSTER}-head-svc"
    assert option(serve.args, "--ray-address") == f"{head}:6379"
    assert option(start.args, "--address") == f"{head}:6379"
    assert option(serve.args, "--dashboard-url") == f"http://{head}:8265"
    assert int(option(serve.args, "--port")) == ports["http"]
    assert option(start.args, "--num-cpus") == option(start.args, "--num-gpus") == "0"


def test_the_service_settings_validate_as_the_pod_sets_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    serve = invocation_of("service.yaml", "kaisa-ray", "serve")
    result = run_kaisa_ray(serve, monkeypatch)
    assert result.exit_code == 0, result.output
    settings = json.loads(result.output)
    env = dict(serve.env)
    assert settings["host"] == "0.0.0.0"
    assert settings["ray_address"] == f"{CLUSTER}-head-svc:6379"
    assert settings["token"] == "<set>"
    assert settings["storage"] == env["KAISA_RAY_STORAGE_PATH"]
    assert settings["database"] == f"sqlite:///{env['KAISA_RAY_DATA_DIR']}/jobs.db"


def test_the_rayjob_runs_the_gpu_example_on_the_raycluster() -> None:
    job = kuberay_objects()[("RayJob", "fashion-mnist-gpu")]
    spec = job["spec"]
    assert spec["clusterSelector"] == {"ray.io/cluster": CLUSTER}
    assert "rayClusterSpec" not in spec
    # What KubeRay's ValidateRayJobSpec refuses with a clusterSelector.
    assert spec.get("submissionMode", "K8sJobMode") in ("K8sJobMode", "HTTPMode")
    assert not spec.get("shutdownAfterJobFinishes", False)
    assert not spec.get("suspend", False)
    assert spec.get("backoffLimit", 0) == 0
    assert re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", job["metadata"]["name"])
    assert len(job["metadata"]["name"]) <= 47
    train = invocation_of("rayjob.yaml", "kaisa-ray", "train")
    assert repo_path(option(train.args, "--config")) == GPU_EXAMPLE
    assert GPU_EXAMPLE.is_file()


def test_the_launcher_config_validates_against_rays_schema() -> None:
    config = launcher_config()
    schema_path = Path(ray.__file__).parent / "autoscaler" / "ray-schema.json"
    jsonschema.validate(config, json.loads(schema_path.read_text()))
    # What `ray up` checks beyond the schema (its validate_config, a private function of
    # Ray's, written out here): the head's type is one of the node types, and the node
    # types' minimum workers fit under the cluster's maximum.
    nodes = config["available_node_types"]
    assert config["head_node_type"] in nodes
    assert sum(n.get("min_workers", 0) for n in nodes.values()) <= config["max_workers"]
    assert nodes[config["head_node_type"]]["resources"].get("GPU", 0) == 0
    gpu = [n for n in nodes.values() if n["resources"].get("GPU", 0) > 0]
    assert gpu
    assert all(n["node_config"]["InstanceType"].startswith("g5.") for n in gpu)
    assert (
        launcher_config()["docker"]["image"]
        == service_deployment()["spec"]["template"]["spec"]["containers"][0]["image"]
    )


def test_the_image_holds_the_data_torch_and_the_project() -> None:
    instructions = dockerfile()
    data_stage = [
        i for i in instructions if i.keyword == "FROM" and "debian:bookworm-slim" in i.args
    ]
    (stage,) = [i.stage for i in data_stage]
    assert any(
        i.keyword == "RUN" and i.stage == stage and "install" in i.args
        for i in instructions
        if "dataset-fashion-mnist" in i.args
    )
    data = str(DEFAULT_FASHION_MNIST_DIR)
    assert any(
        c.flags.get("from") == stage and c.sources == (data,) and c.dest == data for c in copies()
    )
    # torch: the project's pin, from PyTorch's CUDA index.
    pins = dict(
        line.split("==")
        for line in (ROOT / "constraints.txt").read_text().splitlines()
        if "==" in line and not line.startswith("#")
    )
    assert build_args()["TORCH_INDEX_URL"].startswith("https://download.pytorch.org/whl/cu")
    assert any(
        i.keyword == "RUN" and "--index-url" in i.args and f'"torch=={pins["torch"]}"' in i.args
        for i in instructions
    )
    assert any(f"ray.__version__ == '{pins['ray']}'" in i.args for i in instructions)
    # The project: every package pyproject.toml installs, and the files it reads, are copied.
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    sources = {s for c in copies() if "from" not in c.flags for s in c.sources}
    packages = {
        p.rstrip("*") for p in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]
    }
    assert (
        packages | {"pyproject.toml", pyproject["project"]["readme"], "constraints.txt"} <= sources
    )
    for source in sources:
        assert (ROOT / source).exists(), source
        assert not ignored_by_docker(source), f"{source} is copied but kept out of the context"
    for path in (".venv/bin/python", ".git/HEAD", "tests/train/test_deploy.py", "build/lib/x.py"):
        assert ignored_by_docker(path), f"{path} would be sent to the Docker daemon"
    assert ignored_by_docker("kaisa_ray/__pycache__/cli.cpython-311.pyc")
    assert not ignored_by_docker("kaisa_train/cli.py")
    # The examples, at the path the manifests use.
    assert repo_path("/opt/kaisa-ray/examples/fashion_mnist_gpu.yaml") == GPU_EXAMPLE


def test_the_entrypoint_runs_kaisa_ray_subcommands_and_any_other_program(tmp_path: Path) -> None:
    script = (DEPLOY / "docker-entrypoint.sh").read_text()
    (case,) = re.findall(r'^\s*"" \| -\* \| (.*)\)$', script, flags=re.MULTILINE)
    every = service.cli.main.list_commands(click.Context(service.cli.main))  # the lazy ones too
    # All but `head`: in an image that is coreutils' head (the script says why).
    assert sorted(case.split(" | ")) == sorted(set(every) - {"head"})
    stubs = tmp_path / "bin"
    assert run_entrypoint(["serve", "--port", "1"], stubs) == ["kaisa-ray", "serve", "--port", "1"]
    assert run_entrypoint(["--help"], stubs) == ["kaisa-ray", "--help"]
    assert run_entrypoint(["ray", "start", "--head"], stubs) == ["ray", "start", "--head"]
    # `ray up` starts its containers with `docker run ... IMAGE bash`.
    assert run_entrypoint(["bash", "-c", "echo a shell"], stubs) == ["a shell"]


def test_commands_are_found_in_every_file_that_runs_them() -> None:
    sources = {i.source.split()[0] for i in all_invocations()}
    assert sources == {
        "raycluster.yaml",
        "service.yaml",
        "rayjob.yaml",
        "Dockerfile",
        "cluster.yaml",
        "README.md",
    }
    readme = [i for i in all_invocations() if i.source == "README.md"]
    subcommands = {i.args[0] for i in readme if i.program == "kaisa-ray"}
    assert subcommands >= {"submit", "train", "serve", "jobs", "cancel"}
    ray_commands = {" ".join(i.args[:2]) for i in readme if i.program == "ray"}
    assert ray_commands >= {"job submit", "up deploy/cluster.yaml", "exec deploy/cluster.yaml"}


def test_the_service_on_the_ray_up_head_checkpoints_where_the_cluster_does(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    (serve,) = [
        i
        for i in all_invocations()
        if i.source == "README.md" and i.args[:1] == ("serve",) and "--ray-address" in i.args
    ]
    result = run_kaisa_ray(serve, monkeypatch)
    assert result.exit_code == 0, result.output
    # stdout: the settings as JSON (stderr warns that a token on a command line is visible)
    assert json.loads(result.stdout)["storage"] == launcher_env()["KAISA_RAY_STORAGE"]


@pytest.mark.parametrize("invocation", all_invocations(), ids=lambda i: i.id)
def test_every_command_is_accepted_by_its_parser(
    invocation: Invocation, monkeypatch: pytest.MonkeyPatch
) -> None:
    if invocation.program == "ray":
        params = parse_ray(list(invocation.args))
        if invocation.args[:1] == ("exec",):
            assert params["cmd"] == invocation.args[-1]
        for path in params.get("cluster_config_file", None), params.get("working_dir", None):
            assert path is None or (ROOT / path).exists(), path
        return
    result = run_kaisa_ray(invocation, monkeypatch)
    assert result.exit_code == 0, result.output
    if invocation.args[:1] == ("submit",) and not invocation.args[1:2][0].startswith("-"):
        load_job_spec(ROOT / invocation.cwd / invocation.args[1])  # the file it posts is valid


def test_the_readme_names_every_file_in_deploy_and_only_paths_that_exist() -> None:
    readme = (DEPLOY / "README.md").read_text()
    for path in DEPLOY.rglob("*"):
        if path.is_file() and path.name != "README.md" and "__pycache__" not in path.parts:
            assert path.name in readme, f"deploy/README.md does not mention {path.name}"
    for block in readme_code():
        for path in re.findall(r"(?<![\w/.-])((?:deploy|examples)/[\w./-]*\w)", block):
            assert (ROOT / path).exists(), f"deploy/README.md names {path}, which does not exist"


def test_a_misspelt_flag_fails_the_checks(monkeypatch: pytest.MonkeyPatch) -> None:
    serve = invocation_of("service.yaml", "kaisa-ray", "serve")
    misspelt = tuple("--ray-adress" if a == "--ray-address" else a for a in serve.args)
    assert misspelt != serve.args
    result = run_kaisa_ray(
        Invocation(serve.source, serve.program, misspelt, serve.env), monkeypatch
    )
    assert result.exit_code == 2
    assert "No such option '--ray-adress'" in result.output
    head = ray_cluster()["spec"]["headGroupSpec"]
    params = {("num-gpu" if k == "num-gpus" else k): v for k, v in head["rayStartParams"].items()}
    with pytest.raises(click.NoSuchOption, match="num-gpu"):
        parse_ray(kuberay_start_args(params, True, {}))
