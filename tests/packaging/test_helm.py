"""The Helm chart (packaging/helm/liverl): rendered by Helm's own library (helm-python-sdk, no helm binary), checked
against Kubernetes 1.31's schemas with kubernetes-validate (strict: an unknown field fails), then held to what liverl
needs of it: probes and resources on every workload, key files mounted from Secrets and never put in the environment,
each role mounting exactly the files ``core.roles.mounts`` names, the serving nodes under a PodDisruptionBudget, the
learner's ranks under torchrun, every setting a field liverl's config knows, and no service at a loopback address.

Rendered twice: the default values (CPU, two nodes) and ``ci/gpu-values.yaml`` (GPUs, four nodes, eight ingest
workers, the learner on two pods of four ranks, SASL and TLS to Kafka)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

helm = pytest.importorskip("helm_python", reason="helm-python-sdk is not installed (pip install '.[test]')")
kv = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate is not installed (pip install '.[test]')")
yaml = pytest.importorskip("yaml")

from core.config import load_config  # noqa: E402
from core.roles import Role, mounts  # noqa: E402
from tests.conftest import free_port  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "packaging" / "helm" / "liverl"
GPU_VALUES = CHART / "ci" / "gpu-values.yaml"
KUBE = "1.31.0"
RELEASE, NAMESPACE = "lrl", "prod"
WORKLOADS = ("Deployment", "StatefulSet")
KEYS = "/etc/liverl/keys"
LOOPBACK = re.compile(r"127\.0\.0\.1|localhost|\[::1\]", re.I)


def render(values: dict | None = None) -> list[dict]:
    """Every manifest the chart renders with ``values`` (NOTES.txt is text for the operator, not a manifest)."""
    with helm.Chart.load(str(CHART)) as chart:
        out = chart.render(values or {}, name=RELEASE, namespace=NAMESPACE)
    docs = []
    for path, text in sorted(out.items()):
        if path.endswith("NOTES.txt"):
            continue
        docs += [d for d in yaml.safe_load_all(text) if d]
    return docs


@pytest.fixture(scope="module")
def default_docs() -> list[dict]:
    return render()


@pytest.fixture(scope="module")
def gpu_values() -> dict:
    return yaml.safe_load(GPU_VALUES.read_text())


@pytest.fixture(scope="module")
def gpu_docs(gpu_values) -> list[dict]:
    return render(gpu_values)


@pytest.fixture(params=["default", "gpu"])
def docs(request, default_docs, gpu_docs) -> list[dict]:
    return default_docs if request.param == "default" else gpu_docs


def workloads(docs: list[dict]) -> list[dict]:
    return [d for d in docs if d["kind"] in WORKLOADS]


def component(doc: dict) -> str:
    return doc["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"]


def by_component(docs: list[dict], name: str) -> list[dict]:
    return [d for d in workloads(docs) if component(d) == name]


def the(docs: list[dict], kind: str, name: str) -> dict:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} rendered"
    return found[0]


def containers(doc: dict) -> list[dict]:
    spec = doc["spec"]["template"]["spec"]
    return spec.get("initContainers", []) + spec["containers"]


def env_of(container: dict) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in container.get("env", [])}


def strings(node, skip=()) -> list[str]:
    """Every string in a manifest, leaving out the subtrees under the keys in ``skip``."""
    if isinstance(node, dict):
        return [s for k, v in node.items() if k not in skip for s in strings(v, skip)]
    if isinstance(node, list):
        return [s for v in node for s in strings(v, skip)]
    return [node] if isinstance(node, str) else []


# ------------------------------------------------------------------------------------------------ Helm and schemas


def test_the_chart_lints_clean_under_helm_strict():
    report = helm.lint(str(CHART), strict=True, kube_version=f"v{KUBE}")
    assert report["errors"] == [], report
    assert not [m for m in report["messages"] if m["severity"] >= 2], report  # warnings fail under --strict too
    report = helm.lint(str(CHART), yaml.safe_load(GPU_VALUES.read_text()), strict=True, kube_version=f"v{KUBE}")
    assert report["errors"] == [], report


def test_every_manifest_passes_kubernetes_strict_schema_validation(docs):
    assert {d["kind"] for d in docs} >= {"Deployment", "StatefulSet", "Service", "PodDisruptionBudget"}
    for doc in docs:
        kv.validate(doc, KUBE, strict=True)  # raises ValidationError naming the field


def test_strict_validation_does_find_an_unknown_field(default_docs):
    """What the test above relies on: a misspelt field fails, it is not ignored."""
    bad = yaml.safe_load(yaml.safe_dump(by_component(default_docs, "route")[0]))
    bad["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = bad["spec"]["template"]["spec"]["containers"][
        0
    ].pop("readinessProbe")
    with pytest.raises(kv.ValidationError):
        kv.validate(bad, KUBE, strict=True)


def test_a_misspelt_or_out_of_range_value_is_refused_by_the_values_schema():
    with pytest.raises(helm.HelmValuesError, match="replica"):
        render({"route": {"replica": 3}})
    with pytest.raises(helm.HelmValuesError, match="nodes"):
        render({"serve": {"nodes": [{"name": "Node_A"}]}})  # a node names a StatefulSet: a lower-case DNS label


# ------------------------------------------------------------------------------------------------ the roles


def test_every_role_is_a_workload_of_the_one_image_with_its_command(docs):
    roles = {component(w): w for w in workloads(docs)}
    assert set(roles) == {"serve", "route", "ingest", "learn", "gate", "oncall"}
    for w in workloads(docs):
        c = w["spec"]["template"]["spec"]["containers"][0]
        assert c["image"].split(":")[0] == "localhost/liverl", c["image"]
        argv = c.get("command", []) + c["args"]
        want = {"serve": "serve", "route": "route", "ingest": "ingest", "learn": "learn", "gate": "gate"}
        want["oncall"] = "oncall"
        assert want[component(w)] in argv, (w["metadata"]["name"], argv)


def test_every_workload_has_probes_and_resources(docs):
    for w in workloads(docs):
        for c in w["spec"]["template"]["spec"]["containers"]:
            name = f"{w['metadata']['name']}/{c['name']}"
            assert "livenessProbe" in c and "readinessProbe" in c, name
            res = c["resources"]
            assert {"cpu", "memory"} <= set(res["requests"]), name
            assert "memory" in res["limits"], name


def test_probes_use_the_endpoints_each_process_serves(default_docs):
    def probe(role: str, kind: str) -> dict:
        return by_component(default_docs, role)[0]["spec"]["template"]["spec"]["containers"][0][kind]

    for role, port in (("serve", "gateway"), ("route", "http"), ("oncall", "http"), ("gate", "metrics")):
        assert probe(role, "readinessProbe")["httpGet"] == {"path": "/readyz", "port": port}, role
        assert probe(role, "livenessProbe")["httpGet"] == {"path": "/livez", "port": port}, role
    assert "/readyz" in " ".join(probe("ingest", "readinessProbe")["exec"]["command"])
    assert "/livez" in " ".join(probe("ingest", "livenessProbe")["exec"]["command"])
    assert "/readyz" in " ".join(probe("learn", "readinessProbe")["exec"]["command"])
    # a serving node loads its model before it listens: its start-up allows for that before liveness counts
    start = probe("serve", "startupProbe")
    assert start["periodSeconds"] * start["failureThreshold"] >= 600


def test_the_grace_period_outlasts_each_drain(default_docs):
    """SIGTERM drains a node and a router (serving.drain_timeout_s, set from the grace period) before SIGKILL can come:
    a node keeps 40 s of it for stopping vLLM, a router 10 s for its 5 s of /readyz 503 before it stops listening."""

    def pod(role: str) -> dict:
        return by_component(default_docs, role)[0]["spec"]["template"]["spec"]

    for role, kept in (("serve", 40), ("route", 10)):
        spec = pod(role)
        env = {e["name"]: e.get("value") for e in spec["containers"][0]["env"]}
        drain = float(env["LIVERL__SERVING__DRAIN_TIMEOUT_S"])
        assert drain > 0 and drain + kept <= spec["terminationGracePeriodSeconds"], role


def test_prometheus_scrape_annotations_name_each_metrics_port(docs):
    for w in workloads(docs):
        notes = w["spec"]["template"]["metadata"].get("annotations") or {}
        # the on-call page has no metrics
        if component(w) == "oncall":
            assert "prometheus.io/scrape" not in notes
            continue
        assert notes["prometheus.io/scrape"] == "true", w["metadata"]["name"]
        ports = {p["containerPort"] for c in containers(w) for p in c.get("ports", [])}
        assert int(notes["prometheus.io/port"]) in ports, w["metadata"]["name"]


def test_routers_are_several_behind_a_service_and_the_gate_is_one(docs):
    route = by_component(docs, "route")[0]
    assert route["kind"] == "Deployment" and route["spec"]["replicas"] >= 2
    svc = the(docs, "Service", f"{RELEASE}-liverl-route")
    assert svc["spec"]["selector"].items() <= route["spec"]["template"]["metadata"]["labels"].items()
    [gate] = by_component(docs, "gate")
    assert gate["kind"] == "StatefulSet" and gate["spec"]["replicas"] == 1


def test_ingest_workers_are_at_most_the_partitions(docs, gpu_values):
    [ingest] = by_component(docs, "ingest")
    env = env_of(ingest["spec"]["template"]["spec"]["containers"][0])
    assert 1 <= ingest["spec"]["replicas"] <= int(env["LIVERL__BROKER__PARTITIONS"])
    with pytest.raises(helm.HelmRenderError, match="more than kafka.partitions"):
        render({"ingest": {"replicas": 9}, "kafka": {"partitions": 8}})


def test_the_pdb_selects_every_serving_node_and_nothing_else(docs):
    pdb = the(docs, "PodDisruptionBudget", f"{RELEASE}-liverl-serve")
    sel = pdb["spec"]["selector"]["matchLabels"].items()
    nodes = by_component(docs, "serve")
    assert len(nodes) >= 2
    for w in workloads(docs):
        labels = w["spec"]["template"]["metadata"]["labels"].items()
        assert (sel <= labels) == (w in nodes), w["metadata"]["name"]
    assert pdb["spec"].get("maxUnavailable", 0) >= 1 or pdb["spec"]["minAvailable"] < len(nodes)


def test_each_node_is_one_pod_named_in_the_fleet_by_its_stable_dns_name(docs):
    svc = the(docs, "Service", f"{RELEASE}-liverl-serve")
    assert svc["spec"]["clusterIP"] == "None"
    nodes = by_component(docs, "serve")
    fleet = None
    for w in workloads(docs):
        env = env_of(w["spec"]["template"]["spec"]["containers"][0])
        fleet = fleet or env["LIVERL__SERVING__FLEET"]
        assert env["LIVERL__SERVING__FLEET"] == fleet  # every process sees the same fleet
    fleet = load_config(env={"LIVERL__SERVING__FLEET": fleet}).serving.fleet
    assert len(fleet) == len(nodes)
    for w in nodes:
        assert w["kind"] == "StatefulSet" and w["spec"]["replicas"] == 1  # one pod per node name, never two
        assert w["spec"]["serviceName"] == svc["metadata"]["name"]
        env = env_of(w["spec"]["template"]["spec"]["containers"][0])
        name = env["LIVERL__SERVING__NODE_NAME"]
        host = f"{w['metadata']['name']}-0.{svc['metadata']['name']}.{NAMESPACE}.svc.cluster.local"
        assert (
            fleet[name]
            == env["LIVERL__SERVING__ADVERTISE_URL"]
            == f"http://{host}:{env['LIVERL__SERVING__GATEWAY_PORT']}"
        )


# ------------------------------------------------------------------------------------------------ secrets and config


def role_of(w: dict) -> Role:
    env = env_of(w["spec"]["template"]["spec"]["containers"][0])
    processes = {"serve": "node", "route": "router", "learn": "learner", "oncall": "viewer"}
    process = processes.get(component(w), component(w))
    return Role("node", env["LIVERL__SERVING__NODE_NAME"]) if process == "node" else Role(process)


def test_secrets_are_files_from_secrets_never_environment(docs):
    for w in workloads(docs):
        spec = w["spec"]["template"]["spec"]
        volumes = {v["name"]: v for v in spec["volumes"]}
        volumes |= {t["metadata"]["name"]: t for t in w["spec"].get("volumeClaimTemplates", [])}
        for c in containers(w):
            assert "envFrom" not in c, c["name"]
            for e in c.get("env", []):
                assert "secretKeyRef" not in e.get("valueFrom", {}), e
                secretish = re.search(r"PASSWORD$|SECRET|TOKEN|_KEY$", e["name"])
                assert not secretish or e["name"].startswith("LIVERL__SECURITY__"), e
                if e["name"].startswith("LIVERL__SECURITY__"):
                    assert e["value"].startswith(KEYS + "/"), e  # a path to a mounted file, not the key
            for m in c.get("volumeMounts", []):
                if "secret" in volumes[m["name"]]:
                    assert m.get("readOnly") is True, m
                    assert volumes[m["name"]]["secret"]["defaultMode"] & 0o007 == 0  # no one but the pod's user group
        assert all("secret" not in v or "items" not in v["secret"] for v in volumes.values())


def test_each_role_mounts_exactly_the_files_liverl_keys_makes_for_it(docs):
    """The chart's settings per process are the ones `liverl keys` prints: core.roles.mounts, the code's own list."""
    for w in workloads(docs):
        role = role_of(w)
        env = env_of(w["spec"]["template"]["spec"]["containers"][0])
        named = {k: v for k, v in env.items() if v and v.startswith(KEYS + "/")}
        want = {f"LIVERL__{s.upper().replace('.', '__')}": f"{KEYS}/{f}" for f, s in mounts(role)}
        assert named == want, (w["metadata"]["name"], role)
        secret = next(v for v in w["spec"]["template"]["spec"]["volumes"] if v["name"] == "keys")["secret"]
        # <secretPrefix>-<role>, unless the values name the node's own (ci/gpu-values.yaml does for node-d)
        want = "liverl-keys-node-d" if role.node == "node-d" else f"liverl-keys-{role.key}"
        assert secret["secretName"] == want, (w["metadata"]["name"], secret)


def test_each_process_logs_in_as_its_own_role(default_docs):
    for w in workloads(default_docs):
        role = role_of(w)
        env = env_of(w["spec"]["template"]["spec"]["containers"][0])
        user = role.name("liverl_")
        assert env["LIVERL__REGISTRY__URL"].startswith(f"postgresql+psycopg://{user}@postgres:5432/"), env
        assert env["LIVERL__REDIS__URL"].startswith(f"redis://{user}@redis:6379/"), env


def test_every_setting_is_a_field_liverl_knows_and_loads(docs, tmp_path):
    """Each container's LIVERL__ variables load through liverl's own config loader (unknown fields are refused). With
    SASL, the broker's password comes from the config file the operator's Secret holds (LIVERL_CONFIG)."""
    sasl = tmp_path / "liverl.toml"
    sasl.write_text('[broker]\nsasl_password = "from-the-secret"\n')
    for w in workloads(docs):
        for c in containers(w):
            env = {k: v for k, v in env_of(c).items() if v is not None and k.startswith("LIVERL__")}
            if "LIVERL_CONFIG" in env_of(c):
                assert env_of(c)["LIVERL_CONFIG"] == "/etc/liverl/broker/config.toml"
                assert any(m["mountPath"] == "/etc/liverl/broker" for m in c["volumeMounts"])
                env["LIVERL_CONFIG"] = str(sasl)
            cfg = load_config(env=env)
            assert cfg.broker.bootstrap and cfg.registry.url and cfg.redis.url
            assert cfg.serving.host == "0.0.0.0"  # its endpoints answer probes and Prometheus from outside the pod


def test_no_service_is_addressed_at_a_loopback_address(docs):
    """Kafka, Redis, PostgreSQL, S3 and the nodes are reached by name. Only the ingest worker's exec probes use the
    pod's loopback (its web server answers there); the image's name is podman's local registry."""
    for doc in docs:
        found = [s for s in strings(doc, skip=("image", "exec")) if LOOPBACK.search(s)]
        assert not found, (doc["kind"], doc["metadata"]["name"], found)
    for w in workloads(docs):
        for c in containers(w):
            for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
                cmd = " ".join(c.get(kind, {}).get("exec", {}).get("command", []))
                assert not LOOPBACK.search(cmd) or component(w) == "ingest", (w["metadata"]["name"], kind)


# ------------------------------------------------------------------------------------------------ the learner


def torchrun_args(w: dict) -> dict[str, str]:
    c = w["spec"]["template"]["spec"]["containers"][0]
    argv = c["command"] + c["args"]
    assert "torchrun" in argv, argv
    flags = dict(a[2:].split("=", 1) for a in argv[argv.index("torchrun") + 1 :] if a.startswith("--") and "=" in a)
    rest = argv[argv.index("-m") :]
    assert rest[:3] == ["-m", "liverl.cli", "learn"], rest
    return flags


def test_the_learner_runs_its_ranks_under_torchrun(default_docs, gpu_docs, gpu_values):
    for docs, nnodes, nproc in ((default_docs, 1, 1), (gpu_docs, gpu_values["learn"]["nnodes"], 4)):
        [w] = by_component(docs, "learn")
        flags = torchrun_args(w)
        assert w["kind"] == "StatefulSet" and w["spec"]["replicas"] == nnodes == int(flags["nnodes"])
        assert int(flags["nproc-per-node"]) == nproc
        assert w["spec"]["podManagementPolicy"] == "Parallel"  # the ranks meet before any is ready
        svc = the(docs, "Service", w["spec"]["serviceName"])
        assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"] is True
        assert flags["master-addr"].startswith(f"{w['metadata']['name']}-0.{svc['metadata']['name']}.{NAMESPACE}.")
        assert int(flags["master-port"]) in {p["port"] for p in svc["spec"]["ports"]}
        c = w["spec"]["template"]["spec"]["containers"][0]
        env = {e["name"]: e for e in c["env"]}
        assert flags["node-rank"] == "$(NODE_RANK)"
        pod_index = "metadata.labels['apps.kubernetes.io/pod-index']"  # the StatefulSet's ordinal: 0 is rank 0's pod
        assert env["NODE_RANK"]["valueFrom"]["fieldRef"]["fieldPath"] == pod_index
        gpus = c["resources"]["limits"].get("nvidia.com/gpu")
        assert gpus == (nproc if docs is gpu_docs else None)  # one GPU per rank


def test_a_learner_on_several_pods_needs_a_shared_state_volume(gpu_docs, gpu_values):
    [w] = by_component(gpu_docs, "learn")
    state = next(v for v in w["spec"]["template"]["spec"]["volumes"] if v["name"] == "state")
    assert state["persistentVolumeClaim"]["claimName"] == gpu_values["learn"]["sharedStateClaim"]
    with pytest.raises(helm.HelmRenderError, match="sharedStateClaim"):
        render({"learn": {"nnodes": 2}})


# ------------------------------------------------------------------------------------------------ GPUs


def test_gpu_values_put_the_nodes_and_the_learner_on_gpus_and_cpu_values_on_none(default_docs, gpu_docs):
    for w in workloads(default_docs):
        for c in containers(w):
            assert "nvidia.com/gpu" not in str(c["resources"]), w["metadata"]["name"]
            assert c["image"].endswith(":cpu")
    for w in by_component(gpu_docs, "serve"):
        c = w["spec"]["template"]["spec"]["containers"][0]
        assert c["resources"]["limits"]["nvidia.com/gpu"] == 1 and c["image"].endswith(":cuda")
        assert env_of(c)["LIVERL__SERVING__DEVICE"] == "cuda"
    for role in ("route", "ingest", "gate", "oncall"):
        for w in by_component(gpu_docs, role):
            assert "nvidia.com/gpu" not in str(w["spec"]["template"]["spec"]["containers"][0]["resources"])


def test_torchrun_accepts_the_learner_pods_command_line(default_docs):
    """The learner pod's argv, run here as Kubernetes would run it (with $(NODE_RANK) expanded from its env, the
    cluster's name of pod 0 standing for this machine), up to `liverl learn --help` in every rank torchrun starts."""
    [w] = by_component(default_docs, "learn")
    c = w["spec"]["template"]["spec"]["containers"][0]
    argv = c["command"][c["command"].index("torchrun") + 1 :] + c["args"]
    argv = [a.replace("$(NODE_RANK)", "0") for a in argv]
    argv = [re.sub(r"^--master-addr=.*", "--master-addr=127.0.0.1", a) for a in argv]
    argv = [re.sub(r"^--master-port=.*", f"--master-port={free_port()}", a) for a in argv]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", *argv, "--help"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "--metrics-port" in done.stdout  # liverl's own `learn` parser answered, in the rank torchrun started
