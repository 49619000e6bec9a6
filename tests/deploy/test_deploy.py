"""The deployment files (deploy/): the Dockerfiles pass hadolint, the images' entrypoint serves and drains
outside a container, and every kustomize overlay renders (kubectl kustomize, offline) into manifests that
Kubernetes' schemas (kubernetes-validate) and our CRD schemas (deploy/kubernetes/schemas) accept, whose
ferry commands parse with ferry's own CLI and whose gateway reaches every replica the autoscaler may make."""

from __future__ import annotations

import base64
import json
import os
import shutil
import signal
import subprocess
import sys
import tomllib
from pathlib import Path

import httpx
import jsonschema
import pytest
import yaml

from ferry.bench.launch import LaunchedServer
from ferry.cli import build_parser
from ferry.utils.network import free_port

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
BIN = Path(sys.executable).parent  # the venv's bin: hadolint, kubectl and ferry (test extra / the package)
OVERLAYS = ["kubernetes/overlays/cpu", "kubernetes/overlays/gpu", "kubernetes/overlays/gpu-scale-to-zero",
            "kubernetes/overlays/pd", "kubernetes/overlays/pd-redis", "kubernetes/overlays/multi-node",
            "kubernetes/overlays/gateway-tls", "kubernetes/kserve"]  # fmt: skip
# What the kubelet substitutes for $(VAR) in a LeaderWorkerSet pod's args (a worker's index, the leader's name)
LWS_ENV = {"$(LWS_WORKER_INDEX)": "1", "$(LWS_LEADER_ADDRESS)": "ferry-mn-0.ferry-mn"}
K8S_VERSION = "1.33.0"


def tool(name: str) -> str:
    path = shutil.which(name, path=str(BIN)) or shutil.which(name)
    if path is None:
        pytest.fail(f"{name} is not installed (scripts/install.sh installs it with the test extra)")
    return path


def render(overlay: str) -> list[dict]:
    out = subprocess.run([tool("kubectl"), "kustomize", str(DEPLOY / overlay)], capture_output=True, text=True,
                         timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


def by_kind(docs: list[dict], kind: str, name: str | None = None) -> list[dict]:
    return [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]


def pod_specs(doc: dict) -> list[dict]:
    """The pod specs a resource carries (workloads' templates; a ServingRuntime's containers)."""
    if doc["kind"] in ("Deployment", "StatefulSet"):
        return [doc["spec"]["template"]["spec"]]
    if doc["kind"] == "ServingRuntime":
        return [{"containers": doc["spec"]["containers"]}]
    if doc["kind"] == "LeaderWorkerSet":
        template = doc["spec"]["leaderWorkerTemplate"]
        return [template[t]["spec"] for t in ("leaderTemplate", "workerTemplate") if t in template]
    return []


def container_args(container: dict) -> list[str]:
    """A ferry container's command as the entrypoint runs it: bare flags are `serve`, $(VAR)s substituted."""
    args = []
    for arg in container.get("args", []):
        for var, value in LWS_ENV.items():
            arg = arg.replace(var, value)
        args.append(arg)
    return args if args and not args[0].startswith("-") else ["serve", *args]


@pytest.mark.parametrize("dockerfile", ["Dockerfile.cpu", "Dockerfile.cuda"])
def test_dockerfiles_pass_hadolint(dockerfile):
    out = subprocess.run([tool("hadolint"), "--failure-threshold", "info", str(DEPLOY / "docker" / dockerfile)],
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr


def test_hadolint_flags_a_bad_dockerfile(tmp_path):
    """The check above can fail: an unpinned base image and a root `cd` are findings."""
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python\nRUN cd /tmp && pip install ferry\n")
    out = subprocess.run([tool("hadolint"), str(bad)], capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "DL3006" in out.stdout


def test_the_lock_pins_every_runtime_dependency():
    """deploy/docker/requirements.lock (scripts/lock_requirements.sh) names each of pyproject's runtime
    dependencies with an exact version; a new dependency without a new lock fails here."""
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    names = {d.split(";")[0].split("[")[0].split(">")[0].split("=")[0].split("<")[0].strip().lower().replace("_", "-")
             for d in deps} - {"torch", "triton"}  # fmt: skip
    lock = {}
    for line in (DEPLOY / "docker" / "requirements.lock").read_text().splitlines():
        if line and not line.startswith("#"):
            name, version = line.split("==")
            lock[name.lower().replace("_", "-")] = version
    assert names <= set(lock), names - set(lock)
    assert "torch" not in lock and "triton" not in lock  # each image installs its own build


def test_entrypoint_serves_and_drains_outside_a_container(tmp_path):
    """deploy/docker/entrypoint.sh as the images run it: bare flags mean `serve`, the Triton cache goes
    under $FERRY_CACHE_DIR, and SIGTERM drains and exits 0."""
    from torch.utils.cpp_extension import get_default_build_root

    port = free_port()
    env = {
        "PATH": f"{BIN}:{os.environ['PATH']}",
        "FERRY_CACHE_DIR": str(tmp_path / "cache"),
        # the C++ kernels this checkout built already (a fresh directory would rebuild them for minutes)
        "TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root(),
        "PYTHONUNBUFFERED": "1",
    }
    cmd = ["sh", str(DEPLOY / "docker" / "entrypoint.sh"), "--host", "127.0.0.1", "--port", str(port),
           "--max-num-seqs", "2", "--num-kv-blocks", "64", "--drain-timeout", "30"]  # fmt: skip
    server = LaunchedServer(cmd, port, "/ready", 300, env=env)
    url = server.__enter__()
    try:
        r = httpx.post(url + "/v1/completions", json={"prompt": "The capital of France is", "max_tokens": 4,
                                                      "temperature": 0}, timeout=120)  # fmt: skip
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        assert (tmp_path / "cache" / "triton").is_dir()
        server.proc.send_signal(signal.SIGTERM)  # what the kubelet sends after preStop
        assert server.proc.wait(120) == 0
    finally:
        server.__exit__(None, None, None)


def test_entrypoint_passes_subcommands_through():
    env = {**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}", "FERRY_CACHE_DIR": "/tmp/ferry-entrypoint-test"}
    out = subprocess.run(["sh", str(DEPLOY / "docker" / "entrypoint.sh"), "gateway", "--help"], env=env,
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0 and "--worker" in out.stdout


def test_entrypoint_serves_beyond_the_containers_loopback_unless_told(tmp_path):
    """`docker run IMAGE serve /models` replaces the image's CMD and its --host 0.0.0.0: ferry's
    loopback default would then serve nobody outside the container. The entrypoint adds --host
    0.0.0.0 to serve, gateway and up unless a --host is given. (A `ferry` that prints its
    arguments stands in: what is checked is the script's rewriting of them.)"""
    (tmp_path / "ferry").write_text('#!/bin/sh\nprintf "%s\\n" "$@"\n')
    (tmp_path / "ferry").chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}", "FERRY_CACHE_DIR": str(tmp_path / "cache")}

    def argv(*args: str) -> list[str]:
        out = subprocess.run(["sh", str(DEPLOY / "docker" / "entrypoint.sh"), *args], env=env, capture_output=True,
                             text=True, timeout=60, check=True)  # fmt: skip
        return out.stdout.splitlines()

    assert argv() == ["serve", "--host", "0.0.0.0"]
    assert argv("serve", "/models", "--max-model-len", "4096") == ["serve", "/models", "--max-model-len", "4096",
                                                                   "--host", "0.0.0.0"]  # fmt: skip
    assert argv("--max-model-len", "4096") == ["serve", "--max-model-len", "4096", "--host", "0.0.0.0"]
    assert argv("serve", "--host", "127.0.0.1") == ["serve", "--host", "127.0.0.1"]
    assert argv("gateway", "--host=::") == ["gateway", "--host=::"]
    assert argv("bench", "latency") == ["bench", "latency"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_manifests_validate(overlay):
    """Every rendered resource against Kubernetes' schema (strict: unknown fields refused), custom
    resources against deploy/kubernetes/schemas, and every pod spec inside them as a Pod."""
    import kubernetes_validate

    docs = render(overlay)
    assert docs
    schemas = DEPLOY / "kubernetes" / "schemas"
    for doc in docs:
        group_version = doc["apiVersion"].replace("/", "_")
        custom = schemas / f"{group_version}_{doc['kind']}.json"
        if custom.exists():
            jsonschema.validate(doc, json.loads(custom.read_text()))
        else:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        for spec in pod_specs(doc):
            pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "check"}, "spec": spec}
            kubernetes_validate.validate(pod, K8S_VERSION, strict=True)


def test_a_wrong_field_fails_validation():
    """The validation above refuses a misspelt field, in a core resource and in a custom one."""
    import kubernetes_validate

    docs = render("kubernetes/overlays/gpu")
    stateful = by_kind(docs, "StatefulSet")[0]
    stateful["spec"]["template"]["spec"]["containers"][0]["livenesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(stateful, K8S_VERSION, strict=True)
    scaled = by_kind(docs, "ScaledObject")[0]
    scaled["spec"]["maxReplicas"] = 4
    schema = json.loads((DEPLOY / "kubernetes/schemas/keda.sh_v1alpha1_ScaledObject.json").read_text())
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(scaled, schema)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_ferry_commands_parse(overlay):
    """Each ferry container's arguments are a command ferry's own CLI accepts (as the entrypoint runs
    them: bare flags are `serve`)."""
    parser = build_parser()
    seen = 0
    for doc in render(overlay):
        for spec in pod_specs(doc):
            for c in spec["containers"]:
                if not c["image"].split("/")[-1].startswith("ferry:"):
                    continue
                args = container_args(c)
                try:
                    parser.parse_args(args)
                except SystemExit:
                    pytest.fail(f"{doc['kind']} {doc['metadata']['name']}: ferry {' '.join(args)} does not parse")
                seen += 1
    assert seen


GATEWAY_FLAG = {"worker": "--worker", "prefill": "--prefill", "decode": "--decode"}


@pytest.mark.parametrize("overlay", ["kubernetes/overlays/cpu", "kubernetes/overlays/gpu",
                                     "kubernetes/overlays/gpu-scale-to-zero", "kubernetes/overlays/pd",
                                     "kubernetes/overlays/pd-redis", "kubernetes/overlays/gateway-tls"])  # fmt: skip
def test_the_gateway_reaches_every_worker_and_its_secrets(overlay):
    """For each pool (a StatefulSet: workers, or prefill and decode), the gateway lists its pods
    name-0 .. N-1 through the pool's headless Service, N at least its replicas and exactly the
    autoscaler's maximum where one scales it; a prefill pool may push KV blocks to every decode pod it
    could be asked to; the probes and the Secret's keys line up."""
    docs = render(overlay)
    gateway = by_kind(docs, "Deployment", "ferry-gateway")[0]["spec"]["template"]["spec"]["containers"][0]
    secret = by_kind(docs, "Secret", "ferry-secrets")[0]
    keys = set(secret.get("data", {})) | set(secret.get("stringData", {}))
    pools = by_kind(docs, "StatefulSet")
    assert pools
    listed = {}
    for stateful in pools:
        role = stateful["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"]
        service = by_kind(docs, "Service", stateful["spec"]["serviceName"])[0]
        assert service["spec"]["clusterIP"] == "None"
        prefix, port = f"{GATEWAY_FLAG[role]}=", service["spec"]["ports"][0]["port"]
        urls = [a.split("=", 1)[1] for a in gateway["args"] if a.startswith(prefix)]
        name = stateful["metadata"]["name"]
        assert urls == [f"http://{name}-{i}.{service['metadata']['name']}:{port}" for i in range(len(urls))]
        assert len(urls) >= stateful["spec"]["replicas"]
        listed[role] = (len(urls), service)
        scaled = [d for d in by_kind(docs, "ScaledObject") if d["spec"]["scaleTargetRef"]["name"] == name]
        if scaled:  # every replica the autoscaler may add is one the gateway routes to
            assert scaled[0]["spec"]["maxReplicaCount"] == len(urls)
            assert scaled[0]["spec"]["scaleTargetRef"]["kind"] == "StatefulSet"
        worker = stateful["spec"]["template"]["spec"]["containers"][0]
        assert worker["readinessProbe"]["httpGet"]["path"] == "/ready"
        assert {worker["livenessProbe"]["httpGet"]["path"], worker["startupProbe"]["httpGet"]["path"]} == {"/health"}
        refs = {e["valueFrom"]["secretKeyRef"]["key"] for c in (gateway, worker) for e in c.get("env", [])
                if "valueFrom" in e}  # fmt: skip
        assert refs <= keys and "api-keys" in keys
    prefill = [build_parser().parse_args(d["spec"]["template"]["spec"]["containers"][0]["args"])
               for d in by_kind(docs, "StatefulSet", "ferry-prefill")]  # fmt: skip
    if prefill and prefill[0].kv_transfer == "tcp":  # pushes to decode pods (pd-redis: through the store)
        args = prefill[0]
        decode_pods, decode_service = listed["decode"]
        transfer_port = next(p["port"] for p in decode_service["spec"]["ports"] if p["name"] == "kv-transfer")
        decode = by_kind(docs, "StatefulSet", "ferry-decode")[0]["spec"]["template"]["spec"]["containers"][0]
        assert build_parser().parse_args(decode["args"]).kv_transfer_port == transfer_port
        assert args.kv_transfer_allowed_receivers == [
            f"ferry-decode-{i}.{decode_service['metadata']['name']}:{transfer_port}" for i in range(decode_pods)
        ]


def test_multi_node_groups_agree_on_their_layout():
    """A LeaderWorkerSet group: the leader is node 0 (HTTP, probes), the worker pods nodes 1.. by their
    index, all with one parallel layout over `size` nodes and the leader's rendezvous address; the
    gateway routes to each group's leader."""
    docs = render("kubernetes/overlays/multi-node")
    lws = by_kind(docs, "LeaderWorkerSet")[0]
    template = lws["spec"]["leaderWorkerTemplate"]
    parser = build_parser()
    leader = parser.parse_args(container_args(template["leaderTemplate"]["spec"]["containers"][0]))
    worker = parser.parse_args(container_args(template["workerTemplate"]["spec"]["containers"][0]))
    for a in (leader, worker):
        assert a.nnodes == template["size"] and a.master_addr == LWS_ENV["$(LWS_LEADER_ADDRESS)"]
        assert (a.tensor_parallel_size * a.pipeline_parallel_size) % a.nnodes == 0
    assert leader.node_rank == 0 and worker.node_rank == 1 and leader.master_port == worker.master_port
    assert (leader.tensor_parallel_size, leader.pipeline_parallel_size) == (worker.tensor_parallel_size,
                                                                             worker.pipeline_parallel_size)  # fmt: skip
    assert "readinessProbe" in template["leaderTemplate"]["spec"]["containers"][0]
    assert "readinessProbe" not in template["workerTemplate"]["spec"]["containers"][0]  # no HTTP on workers
    gateway = by_kind(docs, "Deployment", "ferry-gateway")[0]["spec"]["template"]["spec"]["containers"][0]
    name = lws["metadata"]["name"]
    assert [a.split("=", 1)[1] for a in gateway["args"] if a.startswith("--worker=")] == [
        f"http://{name}-{i}.{name}:8000" for i in range(lws["spec"]["replicas"])
    ]


def test_each_pd_pool_scales_on_its_own_pods():
    """overlays/pd: one ScaledObject per pool, each query selecting only that pool's pods."""
    docs = render("kubernetes/overlays/pd")
    scaled = {d["spec"]["scaleTargetRef"]["name"]: d for d in by_kind(docs, "ScaledObject")}
    assert set(scaled) == {"ferry-prefill", "ferry-decode"}
    for name, doc in scaled.items():
        other = "ferry-decode" if name == "ferry-prefill" else "ferry-prefill"
        for trigger in doc["spec"]["triggers"]:
            query = trigger["metadata"]["query"]
            assert f'pod=~"{name}-[0-9]+"' in query and other not in query, query


def test_pd_redis_workers_reach_the_store_with_the_secret():
    """overlays/pd-redis: the prefill pool writes KV blocks to Redis; both pools reach the store at its
    Service with the password the store requires, from one Secret key, never in their arguments; only
    they may connect to it."""
    from urllib.parse import urlparse

    from ferry.config import KVTransferConfig

    docs = render("kubernetes/overlays/pd-redis")
    service = by_kind(docs, "Service", "ferry-redis")[0]
    store = by_kind(docs, "Deployment", "ferry-redis")[0]["spec"]["template"]["spec"]["containers"][0]
    assert store["args"][store["args"].index("--requirepass") + 1] == "$(REDIS_PASSWORD)"
    store_key = next(e for e in store["env"] if e["name"] == "REDIS_PASSWORD")["valueFrom"]["secretKeyRef"]
    secret = by_kind(docs, "Secret", "ferry-secrets")[0]
    assert store_key["name"] == "ferry-secrets" and store_key["key"] in secret["data"]
    assert {"api-keys", "kv-transfer-secret"} <= set(secret["data"])  # merged into overlays/pd's, not replacing it
    for pool in ("ferry-prefill", "ferry-decode"):
        c = by_kind(docs, "StatefulSet", pool)[0]["spec"]["template"]["spec"]["containers"][0]
        names = [e["name"] for e in c["env"]]
        assert names.index("REDIS_PASSWORD") < names.index("FERRY_REDIS_URL")  # the kubelet expands earlier vars only
        assert c["env"][names.index("REDIS_PASSWORD")]["valueFrom"]["secretKeyRef"] == store_key
        url = c["env"][names.index("FERRY_REDIS_URL")]["value"]
        parsed = urlparse(url)
        assert parsed.password == "$(REDIS_PASSWORD)" and parsed.hostname == service["metadata"]["name"]
        assert parsed.port == service["spec"]["ports"][0]["port"]
        assert not any("REDIS" in a or "redis://" in a for a in c["args"])
        args = build_parser().parse_args(container_args(c))
        # what `ferry serve` makes of these flags with that environment (serve() reads FERRY_REDIS_URL)
        KVTransferConfig(role=args.role, transport=args.kv_transfer, redis_url=url).validate()
        if pool == "ferry-prefill":
            assert args.kv_transfer == "redis"
    policy = by_kind(docs, "NetworkPolicy", "ferry-redis")[0]["spec"]
    assert policy["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "redis"
    allowed = policy["ingress"][0]["from"][0]["podSelector"]["matchExpressions"][0]["values"]
    assert sorted(allowed) == ["decode", "prefill"] and policy["ingress"][0]["ports"] == [{"port": 6379}]


def test_scale_to_zero_wakes_on_the_gateways_held_requests(tmp_path):
    """overlays/gpu-scale-to-zero: the workers' ScaledObject may go to zero, and one trigger reads the
    gateway itself. The gateway runs here with the manifest's own arguments and Secret, and answers
    the trigger's URL path, with the TriggerAuthentication's token, a number where the trigger looks
    for it; without the token it refuses. With no worker at all it is ready (requests wait)."""
    from urllib.parse import urlparse

    docs = render("kubernetes/overlays/gpu-scale-to-zero")
    scaled = by_kind(docs, "ScaledObject", "ferry-worker")[0]["spec"]
    assert scaled["minReplicaCount"] == 0
    trigger = next(t for t in scaled["triggers"] if t["type"] == "metrics-api")
    meta = trigger["metadata"]
    assert meta["authMode"] == "bearer" and float(meta["activationTargetValue"]) == 0
    auth = by_kind(docs, "TriggerAuthentication", trigger["authenticationRef"]["name"])[0]["spec"]["secretTargetRef"]
    assert [a["parameter"] for a in auth] == ["token"]
    secret = by_kind(docs, "Secret", "ferry-secrets")[0]["data"]
    token = base64.b64decode(secret[auth[0]["key"]]).decode()
    url = urlparse(meta["url"])
    service = by_kind(docs, "Service", "ferry-gateway")[0]
    assert url.hostname.split(".")[0] == service["metadata"]["name"]
    assert (url.port or 80) == service["spec"]["ports"][0]["port"]

    gateway = by_kind(docs, "Deployment", "ferry-gateway")[0]["spec"]["template"]["spec"]["containers"][0]
    (tmp_path / "api-keys").write_text(base64.b64decode(secret["api-keys"]).decode())
    env = {"PYTHONUNBUFFERED": "1"}
    for e in gateway["env"]:  # the Secret's values, as the kubelet gives them
        env[e["name"]] = base64.b64decode(secret[e["valueFrom"]["secretKeyRef"]["key"]]).decode()
    port = free_port()
    args = [a for a in gateway["args"] if not a.startswith(("--host", "--port", "--api-keys"))]
    assert build_parser().parse_args(args).hold_timeout > 0  # requests wait while the pool is at zero
    cmd = [sys.executable, "-m", "ferry.cli", *args, "--host=127.0.0.1", f"--port={port}",
           f"--api-keys={tmp_path / 'api-keys'}"]  # fmt: skip
    with LaunchedServer(cmd, port, "/ready", 120, env=env) as gw:  # ready with no worker reachable
        assert httpx.get(gw + url.path, timeout=10).status_code == 401
        state = httpx.get(gw + url.path, headers={"authorization": f"Bearer {token}"}, timeout=10).json()
        value = state
        for part in meta["valueLocation"].split("."):  # GJSON's dotted path, as KEDA reads it
            value = value[part]
        assert value == 0 and state["hold_timeout"] > 0


def test_gateway_tls_serves_the_mounted_secret():
    """overlays/gateway-tls: the gateway's --ssl-* flags name the files of the mounted TLS Secret and
    refresh them, its probes speak HTTPS, and its Service answers on 443."""
    docs = render("kubernetes/overlays/gateway-tls")
    (gateway,) = by_kind(docs, "Deployment", "ferry-gateway")
    spec = gateway["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    args = build_parser().parse_args(container_args(container))
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == "tls"]
    (volume,) = [v for v in spec["volumes"] if v["name"] == "tls"]
    assert volume["secret"]["secretName"] == "ferry-gateway-tls" and mount["readOnly"]
    assert (args.ssl_certfile, args.ssl_keyfile) == (mount["mountPath"] + "/tls.crt", mount["mountPath"] + "/tls.key")
    assert args.enable_ssl_refresh
    assert {container[p]["httpGet"]["scheme"] for p in ("readinessProbe", "livenessProbe")} == {"HTTPS"}
    (service,) = by_kind(docs, "Service", "ferry-gateway")
    assert service["spec"]["ports"] == [{"name": "https", "port": 443, "targetPort": "http"}]
