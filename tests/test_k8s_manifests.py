"""deployments/k8s/ is one set that applies as it is: every object is valid for a fixed
Kubernetes version, and every name one object uses for another (claims, the Secret and its keys,
the ConfigMap, Services and ports, the image tag, the work pool) is defined where it points.

The schemas come bundled with `kubernetes-validate` (strict: an unknown field is an error), so
nothing here needs a cluster or the network; a guard makes any connection attempt fail.
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from lowtide.settings import Settings
from tests.conftest import REPO

K8S_VERSION = "1.33.0"
"""The Kubernetes version the manifests are checked against (its schemas ship with the pinned
kubernetes-validate)."""
NAMESPACE = "lowtide"
"""The namespace docs/vllm.md applies everything to; it appears inside DNS names."""

K8S = REPO / "deployments" / "k8s"
PREFECT_FILE = K8S / "prefect.yaml"  # Prefect's deployment file, not a Kubernetes object
PROCESS_PREFECT_FILE = REPO / "deployments" / "prefect.yaml"
POOL_TEMPLATE = K8S / "work-pool-template.json"
SECRET = "lowtide-keys"
OPTIONAL_KEYS = {"openai-api-key", "anthropic-api-key", "hf-token"}  # backends that may be unused
WORKLOADS = {"Deployment", "Job", "CronJob", "Pod"}


@pytest.fixture(autouse=True)
def no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    """Validation must work offline: any attempt to connect or resolve a name fails the test."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"network access attempted: {args!r}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)


# --- reading the set -----------------------------------------------------------------------------


def _manifest_files() -> list[Path]:
    return sorted(p for p in K8S.glob("*.yaml") if p != PREFECT_FILE)


def _objects() -> list[tuple[str, dict[str, Any]]]:
    """(file name, object) for every YAML document of every manifest file."""
    found = []
    for path in _manifest_files():
        for doc in yaml.safe_load_all(path.read_text()):
            if doc is not None:
                found.append((path.name, doc))
    return found


def _rendered_pool_job() -> dict[str, Any]:
    """The Job the kubernetes worker makes from the work pool's template, with the variables'
    defaults and a name, rendered by Prefect's own templating (what the worker calls)."""
    from prefect.utilities.templating import apply_values

    template = json.loads(POOL_TEMPLATE.read_text())
    values = {
        k: v["default"] for k, v in template["variables"]["properties"].items() if "default" in v
    }
    values |= {"name": "nightly-run", "labels": {"prefect.io/flow-run-id": "0"}}
    config = apply_values(template["job_configuration"], values, remove_notset=True)
    job = dict(config["job_manifest"])
    # The prefect-kubernetes worker refuses a template whose pod spec lacks these two (a quirk
    # of its manifest check); the API server drops them as unknown pod fields.
    pod = job["spec"]["template"]["spec"]
    assert (pod.pop("parallelism"), pod.pop("completions")) == (1, 1)
    return job


def _all_objects() -> list[tuple[str, dict[str, Any]]]:
    return [*_objects(), (POOL_TEMPLATE.name, _rendered_pool_job())]


def _one(kind: str, name: str) -> dict[str, Any]:
    matches = [o for _, o in _objects() if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(matches) == 1, f"expected one {kind} {name!r} in deployments/k8s/, found {matches}"
    return matches[0]


def _names(kind: str) -> set[str]:
    return {o["metadata"]["name"] for _, o in _objects() if o["kind"] == kind}


def _pod_spec(obj: dict[str, Any]) -> dict[str, Any]:
    if obj["kind"] == "Pod":
        return dict(obj["spec"])
    if obj["kind"] == "CronJob":
        return dict(obj["spec"]["jobTemplate"]["spec"]["template"]["spec"])
    return dict(obj["spec"]["template"]["spec"])


def _pod_specs() -> Iterator[tuple[str, dict[str, Any]]]:
    """(where, pod spec) of every workload, the work pool's Job included."""
    for file, obj in _all_objects():
        if obj["kind"] in WORKLOADS:
            yield (
                f"{file}: {obj['kind']} {obj['metadata'].get('name', '(generated)')}",
                _pod_spec(obj),
            )


def _containers(spec: dict[str, Any]) -> list[dict[str, Any]]:
    return [*spec.get("initContainers", []), *spec["containers"]]


def _env(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in container.get("env", [])}


def _port(container: dict[str, Any], port: int | str) -> int:
    """A port given by number or by the container port's name, as a number."""
    if isinstance(port, int):
        return port
    named = {p["name"]: p["containerPort"] for p in container.get("ports", [])}
    assert port in named, f"container {container['name']} has no port named {port!r}"
    return int(named[port])


def _image_tag() -> str:
    """The tag deployments/k8s/Dockerfile says to build: `docker build ... -t TAG .`."""
    m = re.search(r"docker build .*-t (\S+) \.", (K8S / "Dockerfile").read_text())
    assert m, "deployments/k8s/Dockerfile documents no `docker build ... -t TAG .`"
    return m.group(1)


def _job_file() -> dict[str, Any]:
    return tomllib.loads(_one("ConfigMap", "lowtide-job")["data"]["job.toml"])


# --- every object is valid Kubernetes ------------------------------------------------------------


@pytest.mark.parametrize(
    ("file", "obj"),
    [
        pytest.param(f, o, id=f"{f}:{o['kind']}/{o['metadata'].get('name', '')}")
        for f, o in _all_objects()
    ],
)
def test_every_object_is_valid_for_the_kubernetes_version(file: str, obj: dict[str, Any]) -> None:
    try:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    except kubernetes_validate.ValidationError as e:
        where = ".".join(str(p) for p in e.path)
        pytest.fail(f"{file}: {obj['kind']} {obj['metadata'].get('name')}: {where}: {e.message}")


def test_the_validator_rejects_a_misspelled_field() -> None:
    """The check above has teeth: strict schemas refuse a field Kubernetes does not know."""
    bad = json.loads(json.dumps(_one("Deployment", "vllm")))
    bad["spec"]["replica"] = bad["spec"].pop("replicas")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSION, strict=True)


def test_the_manifest_files_are_the_expected_set() -> None:
    """A new file gets validated by the tests above; one that disappears is noticed here."""
    assert {p.name for p in _manifest_files()} == {
        "lowtide-run.yaml",
        "prefect-server.yaml",
        "prefect-worker.yaml",
        "secret.template.yaml",
        "storage.yaml",
        "toolbox.yaml",
        "vllm-run-batch-indexed-job.yaml",
        "vllm-servers.yaml",
    }


def test_the_work_pool_template_declares_every_placeholder() -> None:
    """`prefect work-pool create --base-job-template` refuses a placeholder with no variable."""
    template = json.loads(POOL_TEMPLATE.read_text())
    used = set(re.findall(r"\{\{\s*([a-z_]+)\s*\}\}", json.dumps(template["job_configuration"])))
    assert used <= set(template["variables"]["properties"])
    assert template["variables"]["properties"]["namespace"]["default"] == NAMESPACE


# --- cross-references -----------------------------------------------------------------------------


def test_every_claim_is_defined_and_every_defined_claim_is_used() -> None:
    defined = _names("PersistentVolumeClaim")
    used = set()
    for where, spec in _pod_specs():
        for volume in spec.get("volumes", []):
            if "persistentVolumeClaim" in volume:
                claim = volume["persistentVolumeClaim"]["claimName"]
                assert claim in defined, f"{where} mounts claim {claim!r}; defined: {defined}"
                used.add(claim)
    assert defined == used, f"claims nobody mounts: {defined - used}"


def test_volume_mounts_name_volumes_of_their_pod_and_configmaps_exist() -> None:
    configmaps = _names("ConfigMap")
    for where, spec in _pod_specs():
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        for c in _containers(spec):
            for mount in c.get("volumeMounts", []):
                assert mount["name"] in volumes, f"{where}: {c['name']} mounts {mount['name']!r}"
        for v in volumes.values():
            if "configMap" in v:
                assert v["configMap"]["name"] in configmaps, f"{where}: {v['configMap']}"
            assert "secret" not in v, f"{where}: keys come in as env from {SECRET}, not files"


def _secret_refs() -> Iterator[tuple[str, str, dict[str, Any]]]:
    """(where, env var name, secretKeyRef) of every key any container reads."""
    for where, spec in _pod_specs():
        for c in _containers(spec):
            for source in c.get("envFrom", []):
                assert "secretRef" not in source, f"{where}: name each key (secretKeyRef)"
            for name, e in _env(c).items():
                ref = e.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    yield f"{where}: {c['name']}", name, ref


def test_every_key_comes_from_the_one_secret_and_exists_in_its_template() -> None:
    keys = set(_one("Secret", SECRET)["stringData"])
    refs = list(_secret_refs())
    assert refs
    for where, var, ref in refs:
        assert ref["name"] == SECRET, f"{where}: {var} from Secret {ref['name']!r}"
        assert ref["key"] in keys, f"{where}: {var} reads key {ref['key']!r}; the Secret has {keys}"
        assert ref.get("optional", False) == (ref["key"] in OPTIONAL_KEYS), (
            f"{where}: {var} should {'' if ref['key'] in OPTIONAL_KEYS else 'not '}be optional"
        )
    assert {ref["key"] for _, _, ref in refs} == keys, "keys in the Secret that nothing reads"


def _lowtide_containers() -> Iterator[tuple[str, dict[str, Any]]]:
    tag = _image_tag()
    for where, spec in _pod_specs():
        for c in _containers(spec):
            if c["image"] == tag or c["image"].startswith("lowtide"):
                yield f"{where}: {c['name']}", c


def test_lowtide_reads_the_variables_the_manifests_set() -> None:
    """LOWTIDE_* names are settings fields; provider keys are the variables the backends read."""
    settings = {f"LOWTIDE_{f.upper()}" for f in Settings.model_fields}
    sources = "\n".join(p.read_text() for p in (REPO / "lowtide").rglob("*.py"))
    provider_keys = set(re.findall(r'require_key\(\s*"\w+",\s*"([A-Z_]+)"', sources))
    assert {"OPENAI_API_KEY", "ANTHROPIC_API_KEY"} <= provider_keys
    for where, c in _lowtide_containers():
        for name, e in _env(c).items():
            if name.startswith("LOWTIDE_"):
                assert name in settings, f"{where}: lowtide has no setting {name}"
            if "secretKeyRef" in e.get("valueFrom", {}):
                assert name in provider_keys | {"LOWTIDE_VLLM_API_KEY"}, f"{where}: {name}"


def test_the_vllm_service_is_headless_and_matches_the_servers() -> None:
    deployment, service = _one("Deployment", "vllm"), _one("Service", "vllm")
    assert service["spec"]["clusterIP"] == "None"
    pod = deployment["spec"]["template"]
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert (
        deployment["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    )
    (server,) = pod["spec"]["containers"]
    (port,) = service["spec"]["ports"]
    served = _port(server, port["targetPort"])
    assert port["port"] == served
    assert f"--port={served}" in server["args"]
    probe = server["readinessProbe"]["httpGet"]
    assert probe["path"] == "/health" and _port(server, probe["port"]) == served
    assert server["resources"]["limits"]["nvidia.com/gpu"] >= 1
    assert (
        server["resources"]["requests"]["nvidia.com/gpu"]
        == server["resources"]["limits"]["nvidia.com/gpu"]
    )


def _served_model_name(args: list[str] | str) -> str:
    text = args if isinstance(args, str) else " ".join(args)
    m = re.search(r"--served-model-name[= ](\S+)", text)
    assert m, f"no --served-model-name in {text!r}"
    return m.group(1)


def test_the_job_file_discovers_the_headless_service_and_asks_its_model() -> None:
    job = _job_file()
    service = _one("Service", "vllm")
    (port,) = service["spec"]["ports"]
    name = f"{service['metadata']['name']}.{NAMESPACE}.svc.cluster.local"
    assert job["pool"]["discover"] == f"dns:{name}:{port['port']}"
    assert job["model"]["backend"] == "vllm"
    server = _one("Deployment", "vllm")["spec"]["template"]["spec"]["containers"][0]
    batch = _one("Job", "vllm-run-batch")["spec"]["template"]["spec"]["containers"][0]
    assert _served_model_name(server["args"]) == job["model"]["name"]
    assert _served_model_name(batch["args"]) == job["model"]["name"]


def test_input_comes_from_the_data_claim_not_the_configmap() -> None:
    configmap = _one("ConfigMap", "lowtide-job")
    assert set(configmap["data"]) == {"job.toml", "schema.json"}
    job = _job_file()
    spec = _pod_spec(_one("CronJob", "lowtide-nightly"))
    (run,) = spec["containers"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    mounts = {m["mountPath"]: volumes[m["name"]] for m in run["volumeMounts"]}
    data_mount = next(
        p
        for p, v in mounts.items()
        if "persistentVolumeClaim" in v
        and v["persistentVolumeClaim"]["claimName"] == "lowtide-data"
    )
    for path in (job["input"]["path"], job["qa"]["eval_set"]):
        assert path.startswith(data_mount + "/"), f"{path} is not on the claim lowtide-data"
    job_mount = next(p for p, v in mounts.items() if "configMap" in v)
    assert run["command"][-1] == f"{job_mount}/job.toml"
    assert job["output"]["schema_file"] in configmap["data"]


def test_the_job_file_in_the_configmap_loads_with_lowtides_loader(tmp_path: Path) -> None:
    from lowtide.jobspec import PoolSpec, load_job

    if "discover" not in PoolSpec.model_fields:
        pytest.skip("[pool] discover is not in lowtide's job file yet (PoolSpec has no field)")
    data = _one("ConfigMap", "lowtide-job")["data"]
    for key, text in data.items():
        (tmp_path / key).write_text(text)
    job = load_job(tmp_path / "job.toml")
    assert job.pool.discover == _job_file()["pool"]["discover"]
    assert job.output_schema["required"] == ["intent", "urgency", "summary"]


def test_prefect_api_url_is_the_prefect_service() -> None:
    deployment, service = _one("Deployment", "prefect"), _one("Service", "prefect")
    pod = deployment["spec"]["template"]
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    (server,) = pod["spec"]["containers"]
    (port,) = service["spec"]["ports"]
    assert port["port"] == _port(server, port["targetPort"])
    assert str(port["port"]) in server["command"]
    probe = server["readinessProbe"]["httpGet"]
    assert probe["path"] == "/api/health" and _port(server, probe["port"]) == port["port"]
    url = f"http://{service['metadata']['name']}.{NAMESPACE}.svc.cluster.local:{port['port']}/api"
    for where, c in _lowtide_containers():
        if where.startswith(POOL_TEMPLATE.name) or c["command"][:3] == [
            "prefect",
            "server",
            "start",
        ]:
            continue  # the pool's flow runs get PREFECT_API_URL from the worker
        assert _env(c).get("PREFECT_API_URL", {}).get("value") == url, where


def test_every_lowtide_image_is_the_dockerfile_tag() -> None:
    tag = _image_tag()
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert tag == f"lowtide:{project['version']}"
    images = [c["image"] for _, c in _lowtide_containers()]
    assert images and set(images) == {tag}
    deployments = yaml.safe_load(PREFECT_FILE.read_text())["deployments"]
    assert {d["work_pool"]["job_variables"]["image"] for d in deployments} == {tag}


def test_the_dockerfile_holds_what_the_manifests_run() -> None:
    dockerfile = (K8S / "Dockerfile").read_text()
    workdir = re.search(r"^WORKDIR (\S+)", dockerfile, re.M)
    assert workdir
    for folder in ("lowtide", "flows", "tasks"):
        assert re.search(rf"^COPY {folder} \./{folder}$", dockerfile, re.M), folder
    # the worker of prefect-worker.yaml runs --type kubernetes from this image
    assert "prefect-kubernetes" in dockerfile
    # flow runs of the kubernetes pool start where the flows are
    pull = yaml.safe_load(PREFECT_FILE.read_text())["pull"]
    assert pull == [
        {"prefect.deployments.steps.set_working_directory": {"directory": workdir.group(1)}}
    ]


def test_the_run_batch_job_reads_and_writes_the_shard_file_names(tmp_path: Path) -> None:
    """Pod 7 reads DIR/input-00007.jsonl and writes DIR/output-00007.jsonl, DIR on the data
    claim (the names `lowtide shards export/import` use)."""
    job = _one("Job", "vllm-run-batch")
    assert job["spec"]["completionMode"] == "Indexed"
    spec = job["spec"]["template"]["spec"]
    (c,) = spec["containers"]
    env = _env(c)
    assert env["DIR"]["value"] == "/data/batch/$(RUN)"
    data = next(m for m in c["volumeMounts"] if m["mountPath"] == "/data")
    claim = {v["name"]: v for v in spec["volumes"]}[data["name"]]["persistentVolumeClaim"]
    assert claim["claimName"] == "lowtide-data"
    script = c["args"][0].replace("exec vllm run-batch", "echo")
    out = subprocess.run(
        [*c["command"], script],
        env={"PATH": "/usr/bin:/bin", "JOB_COMPLETION_INDEX": "7", "DIR": "/d"},
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert out.startswith("-i /d/input-00007.jsonl -o /d/output-00007.jsonl "), out


def test_the_kubernetes_pool_mirrors_the_process_pool() -> None:
    """Same deployments, flows and schedules as deployments/prefect.yaml, on the pool
    `lowtide-k8s`, which the worker serves; the job file is the ConfigMap's."""
    k8s = {d["name"]: d for d in yaml.safe_load(PREFECT_FILE.read_text())["deployments"]}
    process = {
        d["name"]: d for d in yaml.safe_load(PROCESS_PREFECT_FILE.read_text())["deployments"]
    }
    assert set(k8s) == set(process)
    for name, d in k8s.items():
        for key in ("entrypoint", "schedules", "concurrency_limit", "tags"):
            assert d[key] == process[name][key], (name, key)
        assert d["work_pool"]["name"] == "lowtide-k8s"
        assert process[name]["work_pool"]["name"] != "lowtide-k8s"
    assert k8s["nightly-support-intents"]["parameters"]["job_file"] == "/job/job.toml"
    worker = _one("Deployment", "prefect-worker")["spec"]["template"]["spec"]
    (c,) = worker["containers"]
    command = c["command"]
    assert command[command.index("--pool") + 1] == "lowtide-k8s"
    assert command[command.index("--type") + 1] == "kubernetes"
    assert _env(c)["PREFECT_INTEGRATIONS_KUBERNETES_OBSERVER_NAMESPACES"]["value"] == NAMESPACE
    # the worker's service account may create the Jobs: Role, binding and account line up
    binding = _one("RoleBinding", "prefect-worker")
    assert binding["roleRef"]["name"] in _names("Role")
    assert [s["name"] for s in binding["subjects"]] == [worker["serviceAccountName"]]
    assert worker["serviceAccountName"] in _names("ServiceAccount")
    rules = _one("Role", binding["roleRef"]["name"])["rules"]
    assert any("jobs" in r["resources"] and "create" in r["verbs"] for r in rules)


# --- retries: only "retry later" -----------------------------------------------------------------


def _pod_failure_action(policy: dict[str, Any], exit_code: int, conditions: set[str]) -> str:
    """What a Job's podFailurePolicy does with a failed pod, as Kubernetes decides it: the
    first rule that matches (its exit codes, or one of its pod conditions); with none, the
    failure counts against backoffLimit."""
    for rule in policy["rules"]:
        codes = rule.get("onExitCodes")
        if codes and (exit_code in codes["values"]) == (codes["operator"] == "In"):
            return rule["action"]
        if any(c["type"] in conditions for c in rule.get("onPodConditions", [])):
            return rule["action"]
    return "Count"


def test_the_nightly_job_retries_only_exit_75() -> None:
    """lowtide's exit codes (README): 75 retry later; 1 failed, 2 fix the job, 3 held by a
    gate. Retrying a held night would ask its eval set again, and a failed one fail again."""
    job = _one("CronJob", "lowtide-nightly")["spec"]["jobTemplate"]["spec"]
    assert job["template"]["spec"]["restartPolicy"] == "Never"  # else the kubelet restarts it
    assert job["backoffLimit"] >= 1
    (container,) = job["template"]["spec"]["containers"]
    policy = job["podFailurePolicy"]
    assert all(
        r["onExitCodes"]["containerName"] == container["name"]
        for r in policy["rules"]
        if "onExitCodes" in r
    )
    assert _pod_failure_action(policy, 75, set()) == "Count"
    for code in (1, 2, 3, 130, 137, 143):  # 130/143 interrupted, 137 killed (out of memory)
        assert _pod_failure_action(policy, code, set()) == "FailJob", code
    # a node drained under it is no fault of the run's: retried, not counted
    assert _pod_failure_action(policy, 143, {"DisruptionTarget"}) == "Ignore"


def test_prefect_deployments_retry_nothing_themselves() -> None:
    """Flow runs are not retried by Prefect (no flow retries; the work pool's Job has
    backoffLimit 0): a run stopped by a 75 is resumed by the scheduled collect, a held or
    failed one stays for a person (docs/operations.md)."""
    from flows.collect import collect
    from flows.enrich import enrich

    assert not enrich.retries and not collect.retries
    for path in (PREFECT_FILE, PROCESS_PREFECT_FILE):
        for d in yaml.safe_load(path.read_text())["deployments"]:
            assert "retries" not in d and "retries" not in (d.get("job_variables") or {}), d
    template = json.loads(POOL_TEMPLATE.read_text())["job_configuration"]["job_manifest"]
    assert template["spec"]["backoffLimit"] == 0
    assert template["spec"]["template"]["spec"]["restartPolicy"] == "Never"
