#!/usr/bin/python3
"""Renders every kustomization under deploy/k8s/overlays/ and deploy/k8s/jobs/ with
`kubectl kustomize` and checks every object it yields:

- against Kubernetes 1.32's API (deploy/k8s/schema/kubernetes-1.32.json, strict: a misspelt or
  unknown field fails, as kubectl's strict field validation would make it fail at apply);
- against our own rules (RULES below): probes, /dev/shm, GPU limits, labels and selectors,
  the peer list, the cluster size, non-root, the grace period, resources, TLS.

    /usr/bin/python3 tools/check_k8s.py [--kubectl PATH] [--root CHECKOUT] [TARGET ...]

TARGET: a kustomization directory relative to the checkout (default: all of them). Prints one
line per target and object, "ok" or "FAIL" with the reasons under it; exits 1 on any failure,
2 when it cannot run (no kubectl, no schema). deploy/k8s/README.md says what the manifests are.
"""

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib

import jsonschema
import yaml

SCHEMA = "deploy/k8s/schema/kubernetes-1.32.json"
TARGET_DIRS = ("deploy/k8s/overlays", "deploy/k8s/jobs")

# What a target must be, beyond what every target must be. "gpu": ranncd owns CUDA devices;
# "etcd": ranncd uses --cluster-store; "insecure": --insecure allowed (and required) instead of
# TLS and tokens; "local-checkpoints": checkpoints may be on a pod's own volume.
EXPECT = {
    "deploy/k8s/overlays/gpu": {"gpu"},
    "deploy/k8s/overlays/etcd": {"etcd"},
    "deploy/k8s/overlays/dev": {"insecure", "local-checkpoints"},
    "deploy/k8s/jobs/submit-example-dev": {"insecure"},
}

UID = 10001  # the image's user, fixed so that fsGroup and file ownership agree
MIN_GRACE_SECONDS = 60  # a step and a checkpoint finish after SIGTERM
READY_SERVICE = "rannc.ready"  # SERVING once the daemon has joined its cluster
TLS_FLAGS = ("tls-cert", "tls-key", "tls-ca", "auth-token-file")
BOOL_FLAGS = {"insecure"}

RULES = """\
schema     every object is valid for Kubernetes 1.32 (strict: no unknown fields)
probes     every container of a StatefulSet has startup, liveness and readiness probes; ranncd's
           are gRPC on its --health-listen port: "" for startup and liveness, rannc.ready for
           readiness
shm        ranncd's /dev/shm is an emptyDir of medium Memory with a sizeLimit, within the memory
           limit together with its CPU devices' --device-memory (set for CPU devices)
gpu        CUDA devices <=> nvidia.com/gpu in limits (requests equal) and a toleration for it
selectors  every Service, PodDisruptionBudget, NetworkPolicy and StatefulSet selector matches
           the pods of a workload in the same render; Service target ports are the pods' named ports
peers      StatefulSet.serviceName is a headless Service publishing not-ready addresses;
           --advertise is the pod's own name under it and --peers lists exactly replicas such
           names (or, with --cluster-store, the etcd members exist in the render)
size       CLUSTER_SIZE and --cluster-size equal replicas
nonroot    pods run as UID/GID/fsGroup 10001, non-root; containers drop ALL capabilities, no
           privilege escalation, a read-only root file system
grace      ranncd's terminationGracePeriodSeconds >= 60, and its stop_timeout under it
resources  every container requests cpu and memory and has a memory limit
tls        ranncd has --tls-cert/--tls-key/--tls-ca/--auth-token-file on mounted secrets (or
           --insecure where the target expects it); a client has the CA and the token mounted
storage    --state-dir is on a volumeClaimTemplate; rannc.toml parses and its checkpoint_dir is
           on a ReadWriteMany claim; metrics port named and annotated
"""


class Problems(list):
    def add(self, rule, message):
        self.append(f"[{rule}] {message}")


# ---- Values. ---------------------------------------------------------------------------------

_QUANTITY = re.compile(r"^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$")
_QUANTITY_SUFFIX = {"": 1, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "E": 1e18,
                    "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60,
                    "m": 1e-3, "u": 1e-6, "n": 1e-9}
_BYTES = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?)\s*([KMGT]i?B|B)?\s*$")
_BYTE_UNIT = {None: 1, "B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12,
              "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}


def quantity(value):
    """A Kubernetes quantity ("8Gi", 8, "500m") as a number; None when it is not one."""
    if isinstance(value, (int, float)):
        return float(value)
    match = _QUANTITY.match(str(value))
    if not match:
        return None
    suffix = match.group(2)
    try:
        if suffix in _QUANTITY_SUFFIX:
            return float(match.group(1)) * _QUANTITY_SUFFIX[suffix]
        return float(match.group(1) + suffix)  # an exponent: 1e3
    except ValueError:
        return None


def byte_size(text):
    """ranncd's sizes ("2GiB", "512MiB", "0"), as config/options.cc reads them; None if not."""
    match = _BYTES.match(str(text))
    return None if match is None else float(match.group(1)) * _BYTE_UNIT[match.group(2)]


_DURATION = re.compile(r"^([0-9]+(?:\.[0-9]*)?)(ms|s|m|h)$")
_DURATION_UNIT = {"ms": 0.001, "s": 1, "m": 60, "h": 3600}


def duration_seconds(text):
    """ranncd's durations ("110s", "500ms", "10m"), as config/options.cc reads them; None if
    not one."""
    match = _DURATION.match(str(text))
    return None if match is None else float(match.group(1)) * _DURATION_UNIT[match.group(2)]


def expand_env(container):
    """NAME -> value of the container's environment, with $(VAR) expanded as the kubelet does
    (earlier entries only). A downward-API value stands as "{metadata.name}"."""
    resolved = {}

    def expand(text):
        return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
                      lambda m: resolved.get(m.group(1), m.group(0)), text)

    for entry in container.get("env") or []:
        if "value" in entry:
            resolved[entry["name"]] = expand(str(entry["value"]))
        else:
            field = ((entry.get("valueFrom") or {}).get("fieldRef") or {}).get("fieldPath")
            resolved[entry["name"]] = "{" + (field or "valueFrom") + "}"
    return resolved, expand


def parse_flags(args):
    """["--a=1", "--b", "2", "--insecure"] -> {"a": "1", "b": "2", "insecure": ""}."""
    flags, i = {}, 0
    while i < len(args):
        arg = args[i]
        i += 1
        if not arg.startswith("--"):
            continue
        name, eq, value = arg[2:].partition("=")
        if not eq and name not in BOOL_FLAGS and i < len(args) and not args[i].startswith("--"):
            value = args[i]
            i += 1
        flags[name] = value
    return flags


def host_port(address):
    host, _, port = address.rpartition(":")
    return host, int(port) if port.isdigit() else None


# ---- The render. -----------------------------------------------------------------------------

def render(kubectl, directory):
    """The objects `kubectl kustomize DIRECTORY` yields (null fields dropped, as the API server
    drops them)."""
    result = subprocess.run([kubectl, "kustomize", directory], capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"kubectl kustomize {directory} failed:\n{result.stderr.strip()}")
    return [drop_nulls(doc) for doc in yaml.safe_load_all(result.stdout) if doc]


def drop_nulls(value):
    if isinstance(value, dict):
        return {k: drop_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [drop_nulls(v) for v in value]
    return value


def label(obj):
    return f"{obj.get('kind', '?')}/{(obj.get('metadata') or {}).get('name', '?')}"


def pod_spec(obj):
    if obj.get("kind") in ("StatefulSet", "Job"):
        return ((obj.get("spec") or {}).get("template") or {}).get("spec") or {}
    return None


def pod_labels(obj):
    return ((((obj.get("spec") or {}).get("template") or {}).get("metadata") or {})
            .get("labels") or {})


def containers(spec, init=True):
    return list(spec.get("containers") or []) + (list(spec.get("initContainers") or [])
                                                 if init else [])


def is_ranncd(container):
    return os.path.basename((container.get("command") or [""])[0]) == "ranncd"


def is_client(container):
    return os.path.basename((container.get("command") or [""])[0]) == "rannc"


def mount_of(container, path):
    """The volumeMount whose mountPath is the longest prefix of PATH, or None."""
    best = None
    for mount in container.get("volumeMounts") or []:
        root = mount["mountPath"].rstrip("/")
        if (path == root or path.startswith(root + "/")) and (
                best is None or len(root) > len(best["mountPath"].rstrip("/"))):
            best = mount
    return best


def volume(spec, name):
    return next((v for v in spec.get("volumes") or [] if v.get("name") == name), None)


def selects(selector, labels):
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


# ---- Schema. ---------------------------------------------------------------------------------

class Schema:
    def __init__(self, path):
        with open(path) as f:
            document = json.load(f)
        self.source = document["source"]
        self.kinds = document["kinds"]
        self.definitions = document["definitions"]
        self._validators = {}

    def check(self, obj, problems):
        key = f"{obj.get('apiVersion')} {obj.get('kind')}"
        model = self.kinds.get(key)
        if model is None:
            problems.add("schema", f"no schema for {key} (deploy/k8s/schema/gen_schema.py KINDS)")
            return
        if model not in self._validators:
            self._validators[model] = jsonschema.Draft7Validator(
                {"definitions": self.definitions, "$ref": "#/definitions/" + model})
        if not (obj.get("metadata") or {}).get("name"):
            problems.add("schema", "metadata.name is missing")
        for error in sorted(self._validators[model].iter_errors(obj), key=lambda e: list(e.path)):
            where = ".".join(str(p) for p in error.absolute_path) or "(the object)"
            problems.add("schema", f"{where}: {error.message}")


# ---- Rules. ----------------------------------------------------------------------------------

def check_common(obj, everything, problems):
    """The rules for every workload: probes, non-root, resources, selectors."""
    spec = pod_spec(obj)
    kind = obj.get("kind")
    if kind == "StatefulSet":
        selector = ((obj.get("spec") or {}).get("selector") or {}).get("matchLabels") or {}
        if not selects(selector, pod_labels(obj)):
            problems.add("selectors", f"spec.selector {selector} does not match the pod labels "
                                      f"{pod_labels(obj)}")
        for container in spec.get("containers") or []:
            for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
                if probe not in container:
                    problems.add("probes", f"container {container.get('name')} has no {probe}")
    if spec is not None:
        check_nonroot(spec, problems)
        for container in containers(spec):
            resources = container.get("resources") or {}
            requests = resources.get("requests") or {}
            for resource in ("cpu", "memory"):
                if resource not in requests:
                    problems.add("resources", f"container {container.get('name')} requests no "
                                              f"{resource}")
            if "memory" not in (resources.get("limits") or {}):
                problems.add("resources", f"container {container.get('name')} has no memory "
                                          "limit")
    if kind in ("Service", "PodDisruptionBudget", "NetworkPolicy"):
        selector = (obj.get("spec") or {}).get("selector") or {}
        if kind == "PodDisruptionBudget":
            selector = selector.get("matchLabels") or {}
        if kind == "NetworkPolicy":
            selector = ((obj.get("spec") or {}).get("podSelector") or {}).get("matchLabels") or {}
        workloads = [w for w in everything if pod_spec(w) is not None]
        chosen = [w for w in workloads if selects(selector, pod_labels(w))]
        if not chosen:
            problems.add("selectors", f"selector {selector} matches no pods of this render "
                                      f"({', '.join(label(w) for w in workloads) or 'none'})")
        if kind == "Service":
            names = {p.get("name") for w in chosen for c in containers(pod_spec(w), init=False)
                     for p in c.get("ports") or []}
            for port in (obj.get("spec") or {}).get("ports") or []:
                target = port.get("targetPort")
                if isinstance(target, str) and chosen and target not in names:
                    problems.add("selectors", f"port {port.get('name')}: targetPort {target} is "
                                              "no named port of the selected pods")


def check_nonroot(spec, problems):
    pod = spec.get("securityContext") or {}
    if pod.get("runAsNonRoot") is not True:
        problems.add("nonroot", "the pod's securityContext lacks runAsNonRoot: true")
    for field in ("runAsUser", "runAsGroup", "fsGroup"):
        if pod.get(field) != UID:
            problems.add("nonroot", f"the pod's securityContext.{field} is {pod.get(field)}, "
                                    f"not {UID}")
    for container in containers(spec):
        name = container.get("name")
        context = container.get("securityContext") or {}
        if context.get("allowPrivilegeEscalation") is not False:
            problems.add("nonroot", f"container {name}: allowPrivilegeEscalation is not false")
        if context.get("privileged"):
            problems.add("nonroot", f"container {name} is privileged")
        if context.get("readOnlyRootFilesystem") is not True:
            problems.add("nonroot", f"container {name}: readOnlyRootFilesystem is not true")
        if "ALL" not in ((context.get("capabilities") or {}).get("drop") or []):
            problems.add("nonroot", f"container {name} does not drop ALL capabilities")
        if (context.get("capabilities") or {}).get("add"):
            problems.add("nonroot", f"container {name} adds capabilities")
        if context.get("runAsNonRoot") is False or context.get("runAsUser", UID) != UID:
            problems.add("nonroot", f"container {name} overrides the pod's user")


def check_ranncd(sts, everything, expect, problems):
    """The rules for the StatefulSet that runs ranncd."""
    spec = pod_spec(sts)
    container = next(c for c in spec.get("containers") or [] if is_ranncd(c))
    env, expand = expand_env(container)
    flags = {k: expand(v) for k, v in parse_flags(container.get("args") or []).items()}
    replicas = (sts.get("spec") or {}).get("replicas", 1)
    if not isinstance(replicas, int):
        problems.add("size", f"replicas {replicas!r} is not a number")
        replicas = 0
    _, listen_port = host_port(flags.get("listen", "127.0.0.1:7411"))

    # probes
    health = flags.get("health-listen")
    if health is None:
        problems.add("probes", "ranncd has no --health-listen: kubelet's gRPC probes speak plain "
                               "text, and --listen serves TLS")
    else:
        _, health_port = host_port(health)
        for probe, service in (("startupProbe", ""), ("livenessProbe", ""),
                               ("readinessProbe", READY_SERVICE)):
            grpc = (container.get(probe) or {}).get("grpc")
            if grpc is None:
                if probe in container:
                    problems.add("probes", f"ranncd's {probe} is not a gRPC probe")
                continue
            if grpc.get("port") != health_port:
                problems.add("probes", f"ranncd's {probe} dials port {grpc.get('port')}, not "
                                       f"--health-listen's {health_port}")
            if grpc.get("service", "") != service:
                problems.add("probes", f"ranncd's {probe} asks for service "
                                       f"{grpc.get('service', '')!r}, not {service!r}")

    # grace
    grace = spec.get("terminationGracePeriodSeconds", 30)  # Kubernetes' default
    if not isinstance(grace, int) or grace < MIN_GRACE_SECONDS:
        problems.add("grace", f"terminationGracePeriodSeconds is {grace}, under "
                              f"{MIN_GRACE_SECONDS}: a checkpoint may not finish after SIGTERM")

    # size
    if env.get("CLUSTER_SIZE") != str(replicas):
        problems.add("size", f"CLUSTER_SIZE is {env.get('CLUSTER_SIZE')!r}, replicas {replicas}")
    if "cluster-size" in flags and flags["cluster-size"] != str(replicas):
        problems.add("size", f"--cluster-size is {flags['cluster-size']!r}, replicas {replicas}")

    # peers
    headless = next((o for o in everything if o.get("kind") == "Service" and
                     o["metadata"]["name"] == (sts.get("spec") or {}).get("serviceName")), None)
    if headless is None:
        problems.add("peers", f"serviceName {(sts.get('spec') or {}).get('serviceName')!r} is no "
                              "Service of this render")
    else:
        hspec = headless.get("spec") or {}
        if hspec.get("clusterIP") != "None" or hspec.get("publishNotReadyAddresses") is not True:
            problems.add("peers", f"Service {headless['metadata']['name']} is not headless with "
                                  "publishNotReadyAddresses: true")
        name = sts["metadata"]["name"]
        domain = re.escape(f".{headless['metadata']['name']}.{{metadata.namespace}}.svc.")
        advertise = flags.get("advertise", "")
        match = re.fullmatch(r"\{metadata\.name\}" + domain + r"([a-z0-9.-]+):(\d+)", advertise)
        if match is None:
            service = headless["metadata"]["name"]
            problems.add("peers", f"--advertise {advertise!r} is not the pod's own name under "
                                  f"the headless Service: $(POD_NAME).{service}"
                                  f".$(POD_NAMESPACE).svc.DOMAIN:{listen_port}")
        elif int(match.group(2)) != listen_port:
            problems.add("peers", f"--advertise's port {match.group(2)} is not --listen's "
                                  f"{listen_port}")
        elif "cluster-store" in flags:
            if "peers" in flags:
                problems.add("peers", "both --peers and --cluster-store: the daemons find each "
                                      "other in etcd")
        else:
            suffix = advertise[len("{metadata.name}"):]
            want = [f"{name}-{i}{suffix}" for i in range(replicas)]
            got = flags.get("peers", "").split(",")
            if got != want:
                problems.add("peers", f"--peers lists {got}, not the {replicas} pods {want} "
                                      "(values.yaml: peers, with cluster-size)")
    if ("cluster-store" in flags) != ("etcd" in expect):
        problems.add("peers", "--cluster-store " + ("missing" if "etcd" in expect else
                                                     "given where the target expects none"))
    if "cluster-store" in flags:
        check_etcd_endpoints(flags["cluster-store"], everything, problems)

    check_resources_of_ranncd(container, spec, env, flags, expect, problems)
    check_tls(container, spec, flags, expect, problems)
    toml = check_storage(sts, container, spec, env, flags, everything, expect, problems)
    check_stop_timeout(spec, env, flags, toml, problems)


def check_etcd_endpoints(url, everything, problems):
    sets = {o["metadata"]["name"]: o for o in everything if o.get("kind") == "StatefulSet"}
    for endpoint in url.removeprefix("etcd://").split(","):
        host = endpoint.rpartition(":")[0]
        pod, _, service = host.partition(".")
        owner, _, ordinal = pod.rpartition("-")
        member = sets.get(owner)
        if (member is None or not ordinal.isdigit() or
                int(ordinal) >= (member.get("spec") or {}).get("replicas", 1) or
                (member.get("spec") or {}).get("serviceName") != service.split(".")[0]):
            problems.add("peers", f"--cluster-store endpoint {endpoint} is no pod of a "
                                  "StatefulSet in this render")


def check_resources_of_ranncd(container, spec, env, flags, expect, problems):
    devices = flags.get("devices", "")
    limits = (container.get("resources") or {}).get("limits") or {}
    requests = (container.get("resources") or {}).get("requests") or {}
    memory = quantity(limits.get("memory", 0)) or 0

    # shm
    mount = mount_of(container, "/dev/shm")
    shm = volume(spec, mount["name"]) if mount and mount["mountPath"] == "/dev/shm" else None
    empty = (shm or {}).get("emptyDir")
    shm_bytes = 0
    if empty is None or empty.get("medium") != "Memory":
        problems.add("shm", "/dev/shm is not an emptyDir of medium Memory (a container's own is "
                            "64 MiB, which NCCL outgrows)")
    elif "sizeLimit" not in empty:
        problems.add("shm", "the /dev/shm emptyDir has no sizeLimit")
    else:
        shm_bytes = quantity(empty["sizeLimit"]) or 0
    cpu = re.fullmatch(r"cpu:(\d+)", devices)
    budget = shm_bytes
    if cpu:
        each = byte_size(env.get("RANNC_DEVICE_MEMORY", "0"))
        if not each:
            problems.add("shm", "CPU devices without RANNC_DEVICE_MEMORY: ranncd would share "
                                "out the node's memory, not the pod's limit")
        else:
            budget += int(cpu.group(1)) * each
    if memory and budget > memory:
        problems.add("shm", f"devices' memory and /dev/shm ({budget / 2**30:.1f} GiB) exceed "
                            f"the memory limit {limits.get('memory')}")

    # gpu
    gpus = limits.get("nvidia.com/gpu")
    cuda = devices.startswith("cuda")
    if "gpu" in expect and not cuda:
        problems.add("gpu", f"--devices {devices!r} is not CUDA in a GPU target")
    if cuda:
        if not gpus or (quantity(gpus) or 0) <= 0:
            problems.add("gpu", "CUDA devices but no nvidia.com/gpu in the container's limits")
        elif "nvidia.com/gpu" in requests and requests["nvidia.com/gpu"] != gpus:
            problems.add("gpu", "nvidia.com/gpu requests differ from limits")
        if not any(t.get("key") == "nvidia.com/gpu" for t in spec.get("tolerations") or []):
            problems.add("gpu", "no toleration for nvidia.com/gpu")
    elif gpus:
        problems.add("gpu", f"nvidia.com/gpu in limits but --devices {devices!r}")


def check_tls(container, spec, flags, expect, problems):
    if "insecure" in flags:
        if "insecure" not in expect:
            problems.add("tls", "--insecure in a target that must have TLS and tokens")
        return
    if "insecure" in expect:
        problems.add("tls", "no --insecure in an insecure target")
    for flag in TLS_FLAGS:
        if flag not in flags:
            problems.add("tls", f"no --{flag}: a non-loopback --listen needs TLS and tokens")
        else:
            check_secret_file(container, spec, flags[flag], f"--{flag}", problems)


def check_secret_file(container, spec, path, what, problems):
    mount = mount_of(container, path)
    source = (volume(spec, mount["name"]) or {}).get("secret") if mount else None
    if source is None:
        problems.add("tls", f"{what} {path} is not on a mounted Secret")
        return
    key = path[len(mount["mountPath"].rstrip("/")) + 1:]
    items = source.get("items")
    if items is not None and key not in [i.get("path") for i in items]:
        problems.add("tls", f"{what} {path}: secret {source.get('secretName')} is mounted "
                            f"without the item {key}")


def check_storage(sts, container, spec, env, flags, everything, expect, problems):
    """The storage rules; returns the rannc.toml ranncd reads ({} where there is none)."""
    templates = [t["metadata"]["name"] for t in (sts.get("spec") or {}).get(
        "volumeClaimTemplates") or []]
    state = flags.get("state-dir", "")
    mount = mount_of(container, state)
    if not state or mount is None or mount["name"] not in templates:
        problems.add("storage", f"--state-dir {state!r} is not on a volumeClaimTemplate")

    conf_dir = env.get("RANNC_CONF_DIR", "")
    mount = mount_of(container, conf_dir + "/rannc.toml") if conf_dir else None
    config_map = ((volume(spec, mount["name"]) or {}).get("configMap") or {}).get(
        "name") if mount else None
    data = next((o.get("data") or {} for o in everything if o.get("kind") == "ConfigMap" and
                 o["metadata"]["name"] == config_map), None)
    toml = {}
    if data is None or "rannc.toml" not in data:
        problems.add("storage", f"RANNC_CONF_DIR {conf_dir!r} holds no rannc.toml of a "
                                "ConfigMap in this render")
    else:
        try:
            toml = tomllib.loads(data["rannc.toml"])
        except tomllib.TOMLDecodeError as e:
            problems.add("storage", f"rannc.toml does not parse: {e}")
        checkpoints = toml.get("checkpoint_dir")
        mount = mount_of(container, checkpoints) if checkpoints else None
        source = volume(spec, mount["name"]) if mount else None
        claim = ((source or {}).get("persistentVolumeClaim") or {}).get("claimName")
        pvc = next((o for o in everything if o.get("kind") == "PersistentVolumeClaim" and
                    o["metadata"]["name"] == claim), None)
        if checkpoints is None or source is None:
            problems.add("storage", f"checkpoint_dir {checkpoints!r} is on no volume")
        elif pvc is not None:
            if "ReadWriteMany" not in ((pvc.get("spec") or {}).get("accessModes") or []):
                problems.add("storage", f"checkpoint_dir is on {claim}, which is not "
                                        "ReadWriteMany: every daemon of a job writes there")
        elif "local-checkpoints" not in expect:
            problems.add("storage", f"checkpoint_dir {checkpoints} is not on a "
                                    "PersistentVolumeClaim of this render every daemon shares")

    metrics = flags.get("metrics-listen")
    if metrics:
        port = host_port(metrics)[1]
        named = {p.get("name"): p.get("containerPort") for p in container.get("ports") or []}
        annotations = ((sts["spec"]["template"].get("metadata") or {}).get("annotations") or {})
        if named.get("metrics") != port or annotations.get("prometheus.io/port") != str(port):
            problems.add("storage", f"--metrics-listen port {port} is not the container port "
                                    "named metrics and the prometheus.io/port annotation")
    return toml


def check_stop_timeout(spec, env, flags, toml, problems):
    """ranncd's stop_timeout (flag, else environment, else rannc.toml, else 10m) is under the
    pod's grace period: past it ranncd exits saying what it gave up, where the kubelet's SIGKILL
    says nothing."""
    grace = spec.get("terminationGracePeriodSeconds", 30)
    stop = flags.get("stop-timeout", env.get("RANNC_STOP_TIMEOUT", toml.get("stop_timeout")))
    seconds = 600.0 if stop is None else duration_seconds(stop)
    if seconds is None:
        problems.add("grace", f"stop_timeout {stop!r} is not a duration")
    elif isinstance(grace, int) and seconds >= grace:
        problems.add("grace", f"stop_timeout {stop or '10m (the default)'} is not under "
                              f"terminationGracePeriodSeconds {grace}: the kubelet would kill "
                              "ranncd before it gives up on its own, saying what it gave up")


def check_client(job, services, secrets, expect, problems):
    """A Job running `rannc`: it dials a Service of the daemons, with their CA and token."""
    spec = pod_spec(job)
    for container in (c for c in containers(spec) if is_client(c)):
        env, expand = expand_env(container)
        flags = {k: expand(v) for k, v in parse_flags(container.get("args") or []).items()}
        daemon = flags.get("daemon", env.get("RANNC_DAEMON", ""))
        known = ", ".join(sorted(f"{h}:{p}" for h, p in services))
        for address in daemon.split(","):
            if services and tuple(host_port(address)) not in services:
                problems.add("selectors", f"--daemon {address} is no Service port of the "
                                          f"daemons ({known})")
        if "insecure" in expect:
            continue
        for variable in ("RANNC_TLS_CA", "RANNC_TOKEN_FILE"):
            if variable not in env:
                problems.add("tls", f"container {container.get('name')} has no {variable}")
            else:
                check_secret_file(container, spec, env[variable], variable, problems)
    for v in spec.get("volumes") or []:
        name = (v.get("secret") or {}).get("secretName")
        if name and secrets and name not in secrets:
            problems.add("tls", f"secret {name} is none the daemons mount "
                                f"({', '.join(sorted(secrets))})")


def check_target(name, objects, schema, expect, clients=None):
    """[(object label, Problems)] for one render. CLIENTS: (services, secrets) of the daemons'
    renders, for the Jobs that talk to them."""
    results = []
    for obj in objects:
        problems = Problems()
        schema.check(obj, problems)
        check_common(obj, objects, problems)
        spec = pod_spec(obj)
        if obj.get("kind") == "StatefulSet" and any(is_ranncd(c) for c in
                                                   spec.get("containers") or []):
            check_ranncd(obj, objects, expect, problems)
        if obj.get("kind") == "Job":
            check_client(obj, *(clients or (set(), set())), expect, problems)
        results.append((label(obj), problems))
    if not any(o.get("kind") == "StatefulSet" or o.get("kind") == "Job" for o in objects):
        problems = Problems()
        problems.add("schema", "the render has no StatefulSet or Job")
        results.append(("(render)", problems))
    return results


def daemon_endpoints(objects):
    """(Services as {(name, port)}, secrets the daemons mount) of a render."""
    services, secrets = set(), set()
    for obj in objects:
        spec = pod_spec(obj)
        if obj.get("kind") == "StatefulSet" and any(is_ranncd(c) for c in
                                                   spec.get("containers") or []):
            secrets |= {(v.get("secret") or {}).get("secretName") for v in
                        spec.get("volumes") or [] if v.get("secret")}
            for service in objects:
                if service.get("kind") == "Service" and selects(
                        (service.get("spec") or {}).get("selector"), pod_labels(obj)):
                    services |= {(service["metadata"]["name"], p.get("port"))
                                 for p in (service.get("spec") or {}).get("ports") or []}
    return services, secrets


def find_targets(root):
    found = []
    for parent in TARGET_DIRS:
        directory = os.path.join(root, parent)
        for entry in sorted(os.listdir(directory)) if os.path.isdir(directory) else []:
            if os.path.isfile(os.path.join(directory, entry, "kustomization.yaml")):
                found.append(f"{parent}/{entry}")
    return found


def main(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], epilog="rules:\n" + RULES,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kubectl", default=shutil.which("kubectl") or "kubectl",
                        help="the kubectl to render with (its built-in kustomize)")
    parser.add_argument("--root", default=os.path.dirname(os.path.dirname(
        os.path.abspath(__file__))), help="the checkout (default: this script's)")
    parser.add_argument("targets", nargs="*", help="kustomization directories, relative to "
                                                   "--root (default: every one)")
    args = parser.parse_args(argv)

    if shutil.which(args.kubectl) is None:
        print(f"check_k8s: no kubectl at {args.kubectl!r}: give --kubectl PATH", file=sys.stderr)
        return 2
    schema = Schema(os.path.join(args.root, SCHEMA))
    targets = args.targets or find_targets(args.root)
    if not targets:
        print(f"check_k8s: no kustomization under {args.root}/{{{','.join(TARGET_DIRS)}}}",
              file=sys.stderr)
        return 2
    print(f"check_k8s: {len(targets)} targets, schema {schema.source['kubernetes']} "
          f"({schema.source['package']} {schema.source['version']})")

    renders, failed = {}, 0
    # The daemons' renders first: a client Job is checked against their Services and secrets.
    for target in sorted(targets, key=lambda t: t.startswith("deploy/k8s/jobs")):
        try:
            renders[target] = render(args.kubectl, os.path.join(args.root, target))
        except RuntimeError as e:
            print(f"FAIL {target}: {e}")
            failed += 1
            continue
        clients = [daemon_endpoints(objects) for objects in renders.values()]
        services = set().union(*(c[0] for c in clients))
        secrets = set().union(*(c[1] for c in clients))
        for obj_label, problems in check_target(target, renders[target], schema,
                                                EXPECT.get(target, set()),
                                                (services, secrets)):
            print(f"{'FAIL' if problems else 'ok  '} {target} {obj_label}")
            for problem in problems:
                print(f"       {problem}")
            failed += bool(problems)
    print(f"check_k8s: {failed} failure(s)" if failed else "check_k8s: all objects pass")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
