"""Cluster and service definitions under infra/: the AWS cluster launcher YAML against
Ray's own schema, the KubeRay manifests against the fields KubeRay requires, the
Dockerfiles and the team MLflow server's files against what they promise.

Each checker is also run on a broken copy, so a check that can never fail would show.
"""

from __future__ import annotations

import copy
import re
import string
import tomllib
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
INFRA = ROOT / "infra"
PY = "py311"


def _project_requirement(name: str) -> Requirement:
    """The project's own dependency on ``name`` (pyproject.toml)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return next(r for r in map(Requirement, project["dependencies"]) if r.name == name)


def _dockerfile_arg(path: Path, name: str) -> str:
    match = re.search(rf"^ARG {name}=(\S+)$", path.read_text(), re.MULTILINE)
    assert match, f"{path} declares no ARG {name}"
    return match.group(1)


# The one place infra names its Ray release: the project image's base. Every other
# manifest must agree with it, and it must satisfy the project's own Ray requirement
# (tests check that, not which Ray happens to be installed here).
RAY_IMAGE = _dockerfile_arg(INFRA / "docker" / "Dockerfile", "RAY_IMAGE")
RAY_VERSION = re.fullmatch(rf"rayproject/ray:(\d+\.\d+\.\d+)-{PY}-gpu", RAY_IMAGE).group(1)
# values for the k8s manifests' envsubst placeholders, as a user would export them
K8S_VALUES = {
    "SPLITVIT_IMAGE": "registry.example.com/splitvit:0.1.0",
    "MLFLOW_IMAGE": "registry.example.com/splitvit-mlflow:3.17.2",
    "AWS_REGION": "us-west-2",
    "SPLITVIT_STORAGE": "s3://bucket/splitvit",
    "MLFLOW_ARTIFACTS": "s3://bucket/mlflow",
}


# ---------------------------------------------------------------------- AWS
def _aws_config() -> dict:
    return yaml.safe_load((INFRA / "aws" / "cluster.yaml").read_text())


def _ray_validate(config: dict) -> dict:
    """What `ray up` does before it talks to AWS: fill in the provider defaults, then
    validate against ray/autoscaler/ray-schema.json (and Ray's own consistency checks)."""
    from ray.autoscaler._private.util import prepare_config, validate_config

    prepared = prepare_config(copy.deepcopy(config))
    validate_config(prepared)
    return prepared


def _run_instances_errors(node_config: dict) -> str:
    """EC2 RunInstances parameter errors for a node_config (botocore's own model, offline);
    Ray adds MinCount/MaxCount and, without ImageId, its default AMI."""
    import botocore.session
    from botocore.validate import ParamValidator

    model = botocore.session.get_session().get_service_model("ec2")
    shape = model.operation_model("RunInstances").input_shape
    params = {"ImageId": "ami-0123456789abcdef0", **node_config, "MinCount": 1, "MaxCount": 1}
    report = ParamValidator().validate(params, shape)
    return report.generate_report() if report.has_errors() else ""


def test_aws_cluster_yaml_passes_rays_schema():
    prepared = _ray_validate(_aws_config())
    assert prepared["provider"]["type"] == "aws"
    for name, node_type in _aws_config()["available_node_types"].items():
        assert _run_instances_errors(node_type["node_config"]) == "", name


def test_aws_cluster_has_a_cpu_head_and_autoscaling_gpu_workers():
    config = _aws_config()
    types = config["available_node_types"]
    head = types[config["head_node_type"]]
    assert "GPU" not in head["resources"] and not head["node_config"]["InstanceType"].startswith(("g", "p")), (
        "the head is a CPU instance"
    )
    workers = {n: t for n, t in types.items() if n != config["head_node_type"]}
    assert workers and all(t["resources"].get("GPU", 0) >= 1 for t in workers.values())
    for name, t in workers.items():
        assert 0 <= t.get("min_workers", 0) <= t["max_workers"] <= config["max_workers"], name
    assert sum(t.get("min_workers", 0) for t in workers.values()) == 0, "GPU workers scale from zero"
    markets = [t["node_config"].get("InstanceMarketOptions", {}).get("MarketType") for t in workers.values()]
    assert "spot" in markets and None in markets, "a spot type and an on-demand fallback"
    # the official Ray GPU image of this Ray version and Python 3.11, plus this project
    assert config["docker"]["image"] == RAY_IMAGE
    assert config["file_mounts"]["/home/ray/splitvit"] == "."
    installs = [c for c in config["setup_commands"] if "pip install" in c]
    assert any(c.endswith("-c /home/ray/splitvit/constraints.txt /home/ray/splitvit") for c in installs)
    # the dashboard stays on the head's loopback (reached through `ray dashboard`)
    start = " ".join(config["head_start_ray_commands"])
    assert "--dashboard-host=127.0.0.1" in start and "--dashboard-port=8265" in start


@pytest.mark.parametrize(
    "breakage",
    [
        lambda c: c["available_node_types"]["gpu_spot"].update(min_worker=1),  # typo'd key
        lambda c: c["available_node_types"]["gpu_spot"].pop("resources"),  # required key
        lambda c: c["available_node_types"]["gpu_spot"]["resources"].update(GPU=0.5),  # not an integer
        lambda c: c.update(head_node_type="nope"),
        lambda c: c["docker"].update(imagee="x"),
    ],
)
def test_rays_schema_rejects_a_broken_cluster_yaml(breakage):
    config = _aws_config()
    breakage(config)
    import jsonschema

    with pytest.raises((jsonschema.ValidationError, ValueError)):
        _ray_validate(config)


def test_ec2_model_rejects_a_broken_node_config():
    bad = {
        "InstanceType": "g5.12xlarge",
        "InstanceMarketOptions": {"MarketType": "spot", "SpotOptions": {"MaxPrise": "1"}},
    }
    assert "MaxPrise" in _run_instances_errors(bad)


# ---------------------------------------------------------------------- KubeRay
def _render(path: Path, values: dict[str, str] = K8S_VALUES) -> list[dict]:
    """The manifests after `envsubst` with the documented variables."""
    text = path.read_text()
    placeholders = set(re.findall(r"\$\{(\w+)\}", text))
    assert placeholders <= set(values), f"{path.name}: undocumented placeholders {placeholders - set(values)}"
    rendered = string.Template(text).safe_substitute(values)
    return [d for d in yaml.safe_load_all(rendered) if d]


def _container_problems(where: str, pod_spec: dict) -> list[str]:
    problems = []
    containers = pod_spec.get("containers") or []
    if not containers:
        problems.append(f"{where}.containers: at least one container")
    for i, c in enumerate(containers):
        for key in ("name", "image"):
            if not c.get(key):
                problems.append(f"{where}.containers[{i}].{key}: required")
    return problems


def raycluster_problems(spec: dict, where: str = "spec") -> list[str]:
    """What KubeRay (ray.io/v1 CRD and its validation) refuses in a RayClusterSpec."""
    problems = []
    head = spec.get("headGroupSpec")
    if not isinstance(head, dict):
        return [f"{where}.headGroupSpec: required"]
    if "template" not in head or "spec" not in (head.get("template") or {}):
        problems.append(f"{where}.headGroupSpec.template.spec: required")
    else:
        problems += _container_problems(f"{where}.headGroupSpec.template.spec", head["template"]["spec"])
    if "replicas" in head:
        problems.append(f"{where}.headGroupSpec.replicas: not a field (one head per cluster)")
    if not isinstance(head.get("rayStartParams", {}), dict):
        problems.append(f"{where}.headGroupSpec.rayStartParams: a map of strings")
    names = set()
    for i, group in enumerate(spec.get("workerGroupSpecs") or []):
        at = f"{where}.workerGroupSpecs[{i}]"
        for key in ("groupName", "template"):
            if key not in group:
                problems.append(f"{at}.{key}: required")
        if group.get("groupName") in names:
            problems.append(f"{at}.groupName: duplicate")
        names.add(group.get("groupName"))
        lo, hi = group.get("minReplicas", 0), group.get("maxReplicas", 2**31 - 1)
        replicas = group.get("replicas", lo)
        if not all(isinstance(v, int) and v >= 0 for v in (lo, hi, replicas)):
            problems.append(f"{at}: replicas, minReplicas, maxReplicas are non-negative integers")
        elif not lo <= replicas <= hi:
            problems.append(f"{at}: needs minReplicas <= replicas <= maxReplicas")
        if not all(isinstance(v, str) for v in (group.get("rayStartParams") or {}).values()):
            problems.append(f"{at}.rayStartParams: values are strings")
        if "template" in group:
            problems += _container_problems(f"{at}.template.spec", (group["template"] or {}).get("spec") or {})
    if not all(isinstance(v, str) for v in (head.get("rayStartParams") or {}).values()):
        problems.append(f"{where}.headGroupSpec.rayStartParams: values are strings")
    return problems


def rayjob_problems(job: dict) -> list[str]:
    """What KubeRay refuses in a RayJob (CRD and the operator's ValidateRayJobSpec)."""
    spec = job.get("spec") or {}
    problems = []
    mode = spec.get("submissionMode", "K8sJobMode")
    if mode not in ("K8sJobMode", "HTTPMode", "InteractiveMode", "SidecarMode"):
        problems.append(f"spec.submissionMode: unknown {mode!r}")
    if mode != "InteractiveMode" and not spec.get("entrypoint"):
        problems.append("spec.entrypoint: required (unless InteractiveMode)")
    has_spec, has_selector = "rayClusterSpec" in spec, bool(spec.get("clusterSelector"))
    if has_spec == has_selector:
        problems.append("spec: exactly one of rayClusterSpec and clusterSelector")
    if spec.get("shutdownAfterJobFinishes") and not has_spec:
        problems.append("spec.shutdownAfterJobFinishes: needs rayClusterSpec (KubeRay deletes only clusters it made)")
    if spec.get("ttlSecondsAfterFinished", 0) < 0 or spec.get("backoffLimit", 0) < 0:
        problems.append("spec.ttlSecondsAfterFinished / backoffLimit: >= 0")
    if spec.get("ttlSecondsAfterFinished", 0) > 0 and not spec.get("shutdownAfterJobFinishes"):
        problems.append("spec.ttlSecondsAfterFinished: only with shutdownAfterJobFinishes")
    if "runtimeEnvYAML" in spec:
        try:
            env = yaml.safe_load(spec["runtimeEnvYAML"])
            if not isinstance(env, dict):
                problems.append("spec.runtimeEnvYAML: a YAML mapping")
        except yaml.YAMLError as exc:
            problems.append(f"spec.runtimeEnvYAML: not YAML ({exc})")
    if has_spec:
        problems += raycluster_problems(spec["rayClusterSpec"], "spec.rayClusterSpec")
    return problems


def _one(docs: list[dict], kind: str) -> dict:
    found = [d for d in docs if d.get("kind") == kind]
    assert len(found) == 1, f"one {kind} expected, found {len(found)}"
    return found[0]


def _gpu_groups(spec: dict) -> list[dict]:
    out = []
    for group in spec["workerGroupSpecs"]:
        limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
        if int(limits.get("nvidia.com/gpu", 0)) >= 1:
            out.append(group)
    return out


def test_raycluster_manifest_has_the_fields_kuberay_requires():
    cluster = _one(_render(INFRA / "k8s" / "raycluster.yaml"), "RayCluster")
    assert cluster["apiVersion"] == "ray.io/v1" and cluster["metadata"]["name"]
    spec = cluster["spec"]
    assert raycluster_problems(spec) == []
    assert spec["rayVersion"] == RAY_VERSION, "KubeRay runs the Ray of the project's image"
    assert spec["enableInTreeAutoscaling"] is True
    gpu = _gpu_groups(spec)
    assert gpu and all(g["minReplicas"] == 0 and g["maxReplicas"] >= 1 for g in gpu), (
        "a GPU group that scales from zero"
    )
    for g in gpu:  # GPU nodes are usually tainted; requests must equal limits for extended resources
        pod = g["template"]["spec"]
        assert any(t.get("key") == "nvidia.com/gpu" for t in pod.get("tolerations", []))
        res = pod["containers"][0]["resources"]
        assert res["requests"]["nvidia.com/gpu"] == res["limits"]["nvidia.com/gpu"]
    head = spec["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert head["image"] == K8S_VALUES["SPLITVIT_IMAGE"]
    assert {p["containerPort"] for p in head["ports"]} >= {6379, 8265}


def test_rayjob_runs_the_sweep_with_a_runtime_env_on_the_same_cluster():
    from ray.runtime_env import RuntimeEnv

    job = _one(_render(INFRA / "k8s" / "rayjob-sweep.yaml"), "RayJob")
    assert job["apiVersion"] == "ray.io/v1" and job["metadata"]["name"]
    assert rayjob_problems(job) == []
    spec = job["spec"]
    # the sweep entry point, on a script and search space that exist in the checkout
    words = spec["entrypoint"].split()
    assert words[:2] == ["python", "jobs/sweep.py"] and (ROOT / words[1]).is_file()
    assert (ROOT / words[2]).is_file(), f"search space {words[2]} missing"
    assert f"storage.path={K8S_VALUES['SPLITVIT_STORAGE']}" in spec["entrypoint"], "sweep storage every node reaches"
    # the runtime environment: one Ray accepts, the checkout in the image as working_dir,
    # the package first on every worker's path, MLflow for every process
    env = yaml.safe_load(spec["runtimeEnvYAML"])
    assert env["working_dir"] == "/home/ray/splitvit"
    # Ray checks local paths exist: in the image they are the checkout (the Dockerfile's
    # WORKDIR), so validate against the checkout
    image_root = "/home/ray/splitvit"
    RuntimeEnv(**yaml.safe_load(spec["runtimeEnvYAML"].replace(image_root, str(ROOT))))
    workdir = next(a for i, a in _dockerfile(INFRA / "docker" / "Dockerfile") if i == "WORKDIR")
    assert workdir == image_root
    assert env["py_modules"] == ["/home/ray/splitvit/platform/splitvit"]
    assert env["env_vars"]["MLFLOW_TRACKING_URI"] == "http://mlflow:5000"
    # the job's own cluster is raycluster.yaml's (no drift between the two files)
    cluster = _one(_render(INFRA / "k8s" / "raycluster.yaml"), "RayCluster")
    assert spec["rayClusterSpec"] == cluster["spec"]
    assert _gpu_groups(spec["rayClusterSpec"])


@pytest.mark.parametrize(
    "breakage, expected",
    [
        (lambda j: j["spec"].pop("entrypoint"), "spec.entrypoint"),
        (lambda j: j["spec"].update(clusterSelector={"ray.io/cluster": "x"}), "exactly one of"),
        (lambda j: j["spec"]["rayClusterSpec"].pop("headGroupSpec"), "headGroupSpec: required"),
        (lambda j: j["spec"]["rayClusterSpec"]["workerGroupSpecs"][0].pop("groupName"), "groupName: required"),
        (lambda j: j["spec"]["rayClusterSpec"]["workerGroupSpecs"][0].update(replicas=9), "minReplicas <= replicas"),
        (
            lambda j: j["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0].pop(
                "image"
            ),
            "image: required",
        ),
        (lambda j: j["spec"]["rayClusterSpec"]["headGroupSpec"]["rayStartParams"].update({"num-cpus": 0}), "strings"),
        (lambda j: j["spec"].update(runtimeEnvYAML="working_dir: [unclosed"), "runtimeEnvYAML"),
    ],
)
def test_kuberay_checks_catch_a_broken_rayjob(breakage, expected):
    job = _one(_render(INFRA / "k8s" / "rayjob-sweep.yaml"), "RayJob")
    breakage(job)
    assert any(expected in p for p in rayjob_problems(job)), rayjob_problems(job)


def _serve_sh_required() -> set[str]:
    """The variables infra/mlflow/serve.sh refuses to start without (`: "${VAR:?...}"`)."""
    return set(re.findall(r':\s+"\$\{(\w+):\?', (INFRA / "mlflow" / "serve.sh").read_text()))


def test_k8s_mlflow_server_provides_what_serve_sh_requires():
    docs = _render(INFRA / "k8s" / "mlflow.yaml")
    deploy = next(d for d in docs if d["kind"] == "Deployment")
    assert deploy["apiVersion"] == "apps/v1"
    pod = deploy["spec"]["template"]
    assert deploy["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    container = pod["spec"]["containers"][0]
    assert container["image"] == K8S_VALUES["MLFLOW_IMAGE"]
    env = {e["name"]: e for e in container["env"]}
    required = _serve_sh_required()
    assert required >= {"MLFLOW_BACKEND_STORE_URI", "MLFLOW_ARTIFACTS_DESTINATION"}
    assert required <= set(env), f"missing {required - set(env)}"
    assert env["MLFLOW_BACKEND_STORE_URI"]["value"].startswith("postgresql+psycopg2://")
    assert env["MLFLOW_ARTIFACTS_DESTINATION"]["value"] == K8S_VALUES["MLFLOW_ARTIFACTS"]
    # $(VAR) references only earlier entries (Kubernetes expands nothing else)
    names = [e["name"] for e in container["env"]]
    for i, e in enumerate(container["env"]):
        for ref in re.findall(r"\$\((\w+)\)", e.get("value", "")):
            assert ref in names[:i], f"{e['name']} uses $({ref}) before it is defined"
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"]["path"] == "/health"
    service = next(d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == "mlflow")
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert service["spec"]["ports"][0]["port"] == 5000
    # the Ray pods' MLFLOW_TRACKING_URI is this Service, and the server accepts that Host header
    allowed = env["MLFLOW_ALLOWED_HOSTS"]["value"].split(",")
    import fnmatch

    assert any(fnmatch.fnmatch("mlflow:5000", a) for a in allowed)
    postgres = next(d for d in docs if d["kind"] == "StatefulSet")
    assert (
        postgres["spec"]["selector"]["matchLabels"].items()
        <= postgres["spec"]["template"]["metadata"]["labels"].items()
    )


# ---------------------------------------------------------------------- Docker
def _dockerfile(path: Path) -> list[tuple[str, str]]:
    """(instruction, arguments) pairs, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", path.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def test_dockerfile_installs_the_project_on_the_official_ray_image():
    steps = _dockerfile(INFRA / "docker" / "Dockerfile")
    args = dict(a.split("=", 1) for i, a in steps if i == "ARG" and "=" in a)
    base = next(a for i, a in steps if i == "FROM")
    assert base == "${RAY_IMAGE}" and args["RAY_IMAGE"] == RAY_IMAGE
    runs = " ".join(a for i, a in steps if i == "RUN")
    assert "pip install --no-cache-dir --no-deps ." in runs and "import splitvit" in runs
    # the dependency list the image installs is pyproject's (the same snippet, run here)
    snippet = re.search(r'python -c "(import tomllib.*?)"', runs).group(1)
    import subprocess
    import sys

    deps = subprocess.run([sys.executable, "-c", snippet], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert "torch" in deps and "timm" in deps
    # at the builds `make` installs: constraints.txt, copied in with pyproject.toml
    assert any(i == "COPY" and "constraints.txt" in a for i, a in steps)
    assert "pip install --no-cache-dir -c constraints.txt -r /tmp/requirements.txt" in runs
    ignored = (INFRA / "docker" / "Dockerfile.dockerignore").read_text().split()
    assert {".venv", ".git", "runs"} <= set(ignored)


def test_dockerfile_installs_every_preloaded_allocator_and_sets_none():
    """``scaling.allocator`` preloads a library on every worker node: the image has each
    one the allocator table names, and chooses none itself (the config does)."""
    from splitvit.train.allocator import ALLOCATORS

    steps = _dockerfile(INFRA / "docker" / "Dockerfile")
    runs = " ".join(a for i, a in steps if i == "RUN")
    install = re.search(r"apt-get install -y --no-install-recommends ([^&]+)", runs)
    assert install, "the Dockerfile installs no packages with apt-get"
    packages = set(install.group(1).split())
    assert {a.package for a in ALLOCATORS.values() if a.preloads} <= packages
    settings = " ".join(a for i, a in steps if i in ("ENV", "ARG"))
    assert "LD_PRELOAD" not in settings and "MALLOC_" not in settings


def _constraints() -> dict[str, Requirement]:
    """constraints.txt: the exact builds `make`, the image and the cluster's nodes install."""
    lines = (ROOT / "constraints.txt").read_text().splitlines()
    requirements = [Requirement(line) for line in lines if line.strip() and not line.startswith("#")]
    return {r.name: r for r in requirements}


def test_constraints_pin_releases_the_project_accepts():
    pins = _constraints()
    assert {"torch", "torchvision"} <= set(pins)
    for name, pin in pins.items():
        (spec,) = pin.specifier
        assert spec.operator == "==", f"{name}: a constraint pins one build"
        assert spec.version in _project_requirement(name).specifier, f"{name}: outside the project's range"
    # the library asks for ranges, so it installs beside another project's torch
    assert all(s.operator != "==" for s in _project_requirement("torch").specifier)
    assert "-c constraints.txt -e '.[test]'" in (ROOT / "Makefile").read_text()


def test_mlflow_image_and_compose_run_serve_sh_with_a_health_check():
    steps = _dockerfile(INFRA / "mlflow" / "Dockerfile")
    args = dict(a.split("=", 1) for i, a in steps if i == "ARG" and "=" in a)
    assert args["MLFLOW_VERSION"] in _project_requirement("mlflow").specifier, "a server release the clients accept"
    runs = " ".join(a for i, a in steps if i == "RUN")
    assert "mlflow[auth]==" in runs and "psycopg2" in runs and "boto3" in runs
    assert any(i == "HEALTHCHECK" and "healthcheck.py" in a for i, a in steps)
    assert any(i == "ENTRYPOINT" and "serve.sh" in a for i, a in steps)

    compose = yaml.safe_load((INFRA / "mlflow" / "compose.yaml").read_text())
    services = compose["services"]
    assert all("healthcheck" in s for s in services.values())
    assert services["mlflow"]["depends_on"]["postgres"]["condition"] == "service_healthy"
    env = services["mlflow"]["environment"]
    assert _serve_sh_required() <= set(env)
    assert env["MLFLOW_BACKEND_STORE_URI"].startswith("postgresql+psycopg2://")
    # published on loopback unless the operator says otherwise; PostgreSQL not at all
    assert services["mlflow"]["ports"] == ["${MLFLOW_BIND:-127.0.0.1}:5000:5000"]
    assert "ports" not in services["postgres"]
    serve = (INFRA / "mlflow" / "serve.sh").read_text()
    assert "--app-name basic-auth" in serve and "--artifacts-destination" in serve


def test_infra_names_one_ray_release_that_the_project_accepts():
    assert RAY_VERSION in _project_requirement("ray").specifier
    images = re.findall(r"rayproject/ray:[\w.-]+", " ".join(p.read_text() for p in INFRA.rglob("*.yaml")))
    assert images and set(images) == {RAY_IMAGE}, "every manifest runs the project image's Ray"
