#!/usr/bin/python3
"""Tests of tools/check_k8s.py: the checked-in manifests pass, and each kind of mistake it is
there for (a missing probe, a misspelt field, a selector that matches nothing, a GPU overlay
without GPUs, ...) is caught, in a real render with that one mistake put in.

    /usr/bin/python3 -m pytest tools/check_k8s_test.py

Needs kubectl (its built-in kustomize renders the overlays offline).
"""

import copy
import os
import shutil
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import check_k8s  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KUBECTL = shutil.which("kubectl")
CPU = "deploy/k8s/overlays/cpu"
GPU = "deploy/k8s/overlays/gpu"
DEV = "deploy/k8s/overlays/dev"
ETCD = "deploy/k8s/overlays/etcd"
JOB = "deploy/k8s/jobs/submit-example"


@pytest.fixture(scope="module")
def renders():
    if KUBECTL is None:
        pytest.fail("kubectl is needed: check_k8s renders the overlays with `kubectl kustomize`")
    return {target: check_k8s.render(KUBECTL, os.path.join(ROOT, target))
            for target in check_k8s.find_targets(ROOT)}


@pytest.fixture(scope="module")
def schema():
    return check_k8s.Schema(os.path.join(ROOT, check_k8s.SCHEMA))


def problems(renders, schema, target, mutate=None):
    """Every problem check_k8s finds in TARGET's render after MUTATE(objects)."""
    objects = copy.deepcopy(renders[target])
    if mutate is not None:
        mutate(objects)
    clients = [check_k8s.daemon_endpoints(o) for t, o in renders.items() if t != JOB]
    services = set().union(*(c[0] for c in clients))
    secrets = set().union(*(c[1] for c in clients))
    found = []
    for obj_label, obj_problems in check_k8s.check_target(
            target, objects, schema, check_k8s.EXPECT.get(target, set()), (services, secrets)):
        found += [f"{obj_label}: {p}" for p in obj_problems]
    return found


def find(objects, kind, name):
    return next(o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name)


def ranncd(objects):
    return find(objects, "StatefulSet", "ranncd")["spec"]["template"]["spec"]["containers"][0]


def env(container, name):
    return next(e for e in container["env"] if e["name"] == name)


def volume(objects, name):
    spec = find(objects, "StatefulSet", "ranncd")["spec"]["template"]["spec"]
    return next(v for v in spec["volumes"] if v["name"] == name)


def test_the_checked_in_manifests_pass(renders, schema):
    assert set(renders) >= {CPU, GPU, DEV, ETCD, JOB}
    for target in renders:
        assert problems(renders, schema, target) == [], target


def test_the_command_line_passes_and_names_every_object(capsys):
    assert check_k8s.main(["--kubectl", KUBECTL or "kubectl", "--root", ROOT]) == 0
    out = capsys.readouterr().out
    assert f"ok   {GPU} StatefulSet/ranncd" in out
    assert f"ok   {JOB} Job/rannc-submit-example" in out
    assert "FAIL" not in out


def set_grpc_port(port):
    def mutate(objects):
        ranncd(objects)["livenessProbe"]["grpc"]["port"] = port
    return mutate


def rename(key, new):
    def mutate(objects):
        container = ranncd(objects)
        container[new] = container.pop(key)
    return mutate


def drop_readiness(objects):
    del ranncd(objects)["readinessProbe"]


def drop_etcd_probe(objects):
    del find(objects, "StatefulSet", "etcd")["spec"]["template"]["spec"]["containers"][0][
        "livenessProbe"]


def misspell_size_limit(objects):
    empty = volume(objects, "dshm")["emptyDir"]
    empty["sizelimit"] = empty.pop("sizeLimit")


def bad_quantity(objects):
    volume(objects, "dshm")["emptyDir"]["sizeLimit"] = "8GiB"  # ranncd's unit, not Kubernetes'


def replicas_as_text(objects):
    find(objects, "StatefulSet", "ranncd")["spec"]["replicas"] = "2"


def service_selects_nothing(objects):
    find(objects, "Service", "ranncd")["spec"]["selector"]["app.kubernetes.io/name"] = "rannc"


def pdb_selects_nothing(objects):
    find(objects, "PodDisruptionBudget", "ranncd")["spec"]["selector"]["matchLabels"] = {
        "app.kubernetes.io/name": "ranncd-old"}


def pod_labels_changed(objects):
    sts = find(objects, "StatefulSet", "ranncd")
    sts["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"] = "worker"


def target_port_unknown(objects):
    find(objects, "Service", "ranncd")["spec"]["ports"][0]["targetPort"] = "rpc"


def no_gpu_limit(objects):
    resources = ranncd(objects)["resources"]
    del resources["limits"]["nvidia.com/gpu"]
    del resources["requests"]["nvidia.com/gpu"]


def gpu_overlay_on_cpu(objects):
    no_gpu_limit(objects)
    env(ranncd(objects), "DEVICES")["value"] = "cpu:4"


def gpu_requests_differ(objects):
    ranncd(objects)["resources"]["requests"]["nvidia.com/gpu"] = 4


def no_gpu_toleration(objects):
    del find(objects, "StatefulSet", "ranncd")["spec"]["template"]["spec"]["tolerations"]


def gpu_limit_on_cpu(objects):
    ranncd(objects)["resources"]["limits"]["nvidia.com/gpu"] = 1


def headless_renamed(objects):
    find(objects, "Service", "ranncd-headless")["metadata"]["name"] = "ranncd-peers"


def headless_not_headless(objects):
    del find(objects, "Service", "ranncd-headless")["spec"]["publishNotReadyAddresses"]


def service_name_and_peers_disagree(objects):
    # The Service and serviceName renamed together, PEER_DOMAIN (hence --peers) left behind.
    find(objects, "Service", "ranncd-headless")["metadata"]["name"] = "ranncd-peers"
    find(objects, "StatefulSet", "ranncd")["spec"]["serviceName"] = "ranncd-peers"


def more_replicas_than_peers(objects):
    find(objects, "StatefulSet", "ranncd")["spec"]["replicas"] = 3
    env(ranncd(objects), "CLUSTER_SIZE")["value"] = "3"


def cluster_size_differs(objects):
    env(ranncd(objects), "CLUSTER_SIZE")["value"] = "3"


def etcd_member_missing(objects):
    find(objects, "StatefulSet", "etcd")["spec"]["replicas"] = 2


def runs_as_root(objects):
    spec = find(objects, "StatefulSet", "ranncd")["spec"]["template"]["spec"]
    spec["securityContext"]["runAsUser"] = 0


def keeps_capabilities(objects):
    del ranncd(objects)["securityContext"]["capabilities"]


def writable_root(objects):
    ranncd(objects)["securityContext"]["readOnlyRootFilesystem"] = False


def short_grace(objects):
    find(objects, "StatefulSet", "ranncd")["spec"]["template"]["spec"][
        "terminationGracePeriodSeconds"] = 30


def stop_timeout_past_grace(objects):
    ranncd(objects)["args"].append("--stop-timeout=5m")


def no_cpu_request(objects):
    del ranncd(objects)["resources"]["requests"]["cpu"]


def no_memory_limit(objects):
    del ranncd(objects)["resources"]["limits"]["memory"]


def shm_on_disk(objects):
    del volume(objects, "dshm")["emptyDir"]["medium"]


def shm_unbounded(objects):
    del volume(objects, "dshm")["emptyDir"]["sizeLimit"]


def shm_beyond_memory(objects):
    volume(objects, "dshm")["emptyDir"]["sizeLimit"] = "20Gi"  # + 4 x 2 GiB of devices > 24Gi


def cpu_devices_without_memory(objects):
    env(ranncd(objects), "RANNC_DEVICE_MEMORY")["value"] = "0"


def insecure(objects):
    ranncd(objects)["args"].append("--insecure")


def no_token(objects):
    ranncd(objects)["args"].remove("--auth-token-file=/etc/rannc-token/admin.token")


def tls_not_mounted(objects):
    ranncd(objects)["volumeMounts"] = [m for m in ranncd(objects)["volumeMounts"]
                                       if m["name"] != "tls"]


def checkpoints_not_shared(objects):
    find(objects, "PersistentVolumeClaim", "ranncd-checkpoints")["spec"]["accessModes"] = [
        "ReadWriteOnce"]


def health_port_gone(objects):
    ranncd(objects)["args"].remove("--health-listen=0.0.0.0:7412")


def job_dials_elsewhere(objects):
    args = find(objects, "Job", "rannc-submit-example")["spec"]["template"]["spec"][
        "containers"][0]["args"]
    args[0] = "--daemon=ranncd-0:7411"


def job_without_ca(objects):
    container = find(objects, "Job", "rannc-submit-example")["spec"]["template"]["spec"][
        "containers"][0]
    container["env"] = [e for e in container["env"] if e["name"] != "RANNC_TLS_CA"]


CAUGHT = [
    # (target, mistake, what the report says)
    (CPU, drop_readiness, "[probes] container ranncd has no readinessProbe"),
    (ETCD, drop_etcd_probe, "StatefulSet/etcd: [probes] container etcd has no livenessProbe"),
    (CPU, set_grpc_port(7411), "livenessProbe dials port 7411, not --health-listen's 7412"),
    (CPU, health_port_gone, "[probes] ranncd has no --health-listen"),
    (CPU, rename("livenessProbe", "lievnessProbe"), "'lievnessProbe' was unexpected"),
    (CPU, rename("livenessProbe", "lievnessProbe"), "container ranncd has no livenessProbe"),
    (CPU, misspell_size_limit, "'sizelimit' was unexpected"),
    (CPU, bad_quantity, "'8GiB' does not match"),
    (CPU, replicas_as_text, "spec.replicas: '2' is not of type 'integer'"),
    (CPU, service_selects_nothing, "Service/ranncd: [selectors] selector"),
    (CPU, pdb_selects_nothing, "PodDisruptionBudget/ranncd: [selectors] selector"),
    (CPU, pod_labels_changed, "StatefulSet/ranncd: [selectors] spec.selector"),
    (CPU, pod_labels_changed, "Service/ranncd-headless: [selectors] selector"),
    (CPU, target_port_unknown, "targetPort rpc is no named port"),
    (GPU, no_gpu_limit, "[gpu] CUDA devices but no nvidia.com/gpu in the container's limits"),
    (GPU, gpu_overlay_on_cpu, "[gpu] --devices 'cpu:4' is not CUDA in a GPU target"),
    (GPU, gpu_requests_differ, "[gpu] nvidia.com/gpu requests differ from limits"),
    (GPU, no_gpu_toleration, "[gpu] no toleration for nvidia.com/gpu"),
    (CPU, gpu_limit_on_cpu, "[gpu] nvidia.com/gpu in limits but --devices 'cpu:4'"),
    (CPU, headless_renamed, "[peers] serviceName 'ranncd-headless' is no Service"),
    (CPU, headless_not_headless, "is not headless with publishNotReadyAddresses: true"),
    (CPU, service_name_and_peers_disagree, "[peers] --advertise"),
    (CPU, more_replicas_than_peers, "[peers] --peers lists"),
    (CPU, cluster_size_differs, "[size] CLUSTER_SIZE is '3', replicas 2"),
    (CPU, cluster_size_differs, "[size] --cluster-size is '3', replicas 2"),
    (ETCD, etcd_member_missing, "--cluster-store endpoint etcd-2.etcd:2379 is no pod"),
    (CPU, runs_as_root, "[nonroot] the pod's securityContext.runAsUser is 0, not 10001"),
    (ETCD, keeps_capabilities, "[nonroot] container ranncd does not drop ALL capabilities"),
    (CPU, writable_root, "[nonroot] container ranncd: readOnlyRootFilesystem is not true"),
    (CPU, short_grace, "[grace] terminationGracePeriodSeconds is 30, under 60"),
    (CPU, short_grace, "[grace] stop_timeout 110s is not under terminationGracePeriodSeconds 30"),
    (CPU, stop_timeout_past_grace, "[grace] stop_timeout 5m is not under "
                                   "terminationGracePeriodSeconds 120"),
    (CPU, no_cpu_request, "[resources] container ranncd requests no cpu"),
    (GPU, no_memory_limit, "[resources] container ranncd has no memory limit"),
    (CPU, shm_on_disk, "[shm] /dev/shm is not an emptyDir of medium Memory"),
    (DEV, shm_unbounded, "[shm] the /dev/shm emptyDir has no sizeLimit"),
    (CPU, shm_beyond_memory, "exceed the memory limit 24Gi"),
    (CPU, cpu_devices_without_memory, "[shm] CPU devices without RANNC_DEVICE_MEMORY"),
    (CPU, insecure, "[tls] --insecure in a target that must have TLS and tokens"),
    (CPU, no_token, "[tls] no --auth-token-file"),
    (CPU, tls_not_mounted, "[tls] --tls-cert /etc/rannc-tls/tls.crt is not on a mounted Secret"),
    (CPU, checkpoints_not_shared, "[storage] checkpoint_dir is on ranncd-checkpoints, which is "
                                  "not ReadWriteMany"),
    (JOB, job_dials_elsewhere, "[selectors] --daemon ranncd-0:7411 is no Service port"),
    (JOB, job_without_ca, "[tls] container submit has no RANNC_TLS_CA"),
]


@pytest.mark.parametrize("target,mistake,report", CAUGHT,
                         ids=[f"{t.rsplit('/', 1)[1]}-{getattr(m, '__name__', 'mutate')}"
                              for t, m, _ in CAUGHT])
def test_a_mistake_is_caught(renders, schema, target, mistake, report):
    found = problems(renders, schema, target, mistake)
    assert any(report in p for p in found), f"{report!r} not in:\n" + "\n".join(found)


def test_dev_is_insecure_only_on_purpose(renders, schema):
    def secure(objects):
        ranncd(objects)["args"].remove("--insecure")
    assert any("[tls] no --insecure in an insecure target" in p
               for p in problems(renders, schema, DEV, secure))


def copy_tree(tmp_path):
    root = tmp_path / "checkout"
    shutil.copytree(os.path.join(ROOT, "deploy"), root / "deploy")
    return root


def test_a_misspelt_field_in_a_file_fails_the_command(tmp_path, capsys):
    root = copy_tree(tmp_path)
    statefulset = root / "deploy/k8s/base/statefulset.yaml"
    text = statefulset.read_text()
    assert "      terminationGracePeriodSeconds: 120\n" in text
    statefulset.write_text(text.replace("      terminationGracePeriodSeconds: 120\n",
                                        "      terminationGracePeriodSecond: 120\n"))
    assert check_k8s.main(["--kubectl", KUBECTL or "kubectl", "--root", str(root), CPU]) == 1
    out = capsys.readouterr().out
    assert f"FAIL {CPU} StatefulSet/ranncd" in out
    assert "'terminationGracePeriodSecond' was unexpected" in out


def test_a_render_that_fails_fails_the_command(tmp_path, capsys):
    # Reordering the base's args breaks the positional patches, which say so.
    root = copy_tree(tmp_path)
    statefulset = root / "deploy/k8s/base/statefulset.yaml"
    text = statefulset.read_text()
    peers = "        - --peers=$(PEERS)\n"
    log = "        - --log-format=json\n"
    statefulset.write_text(text.replace(peers, "").replace(log, log + peers))
    assert check_k8s.main(["--kubectl", KUBECTL or "kubectl", "--root", str(root), ETCD]) == 1
    out = capsys.readouterr().out
    assert f"FAIL {ETCD}: kubectl kustomize" in out
    assert "testing value /spec/template/spec/containers/0/args/2 failed" in out


def test_values_a_missing_key_fails_the_render(tmp_path, capsys):
    root = copy_tree(tmp_path)
    values = root / "deploy/k8s/overlays/gpu/values.yaml"
    values.write_text("".join(line for line in values.read_text().splitlines(True)
                              if not line.lstrip().startswith("shm-size:")))
    assert check_k8s.main(["--kubectl", KUBECTL or "kubectl", "--root", str(root), GPU]) == 1
    assert "data.shm-size" in capsys.readouterr().out


def test_quantities_and_sizes():
    assert check_k8s.quantity("8Gi") == 8 * 2**30
    assert check_k8s.quantity(8) == 8
    assert check_k8s.quantity("500m") == 0.5
    assert check_k8s.quantity("1e3") == 1000
    assert check_k8s.quantity("8GiB") is None
    assert check_k8s.byte_size("2GiB") == 2 * 2**30
    assert check_k8s.byte_size("1.5GB") == 1.5e9
    assert check_k8s.byte_size("0") == 0
    assert check_k8s.byte_size("2Gi") is None


def test_flags_and_environment_as_the_kubelet_expands_them():
    container = {"env": [
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "D", "value": "svc.$(LATER)"},
        {"name": "A", "value": "$(POD_NAME).$(D)"},
        {"name": "LATER", "value": "x"},
    ]}
    resolved, expand = check_k8s.expand_env(container)
    assert resolved["A"] == "{metadata.name}.svc.$(LATER)"  # only earlier entries expand
    assert expand("--advertise=$(A):1") == "--advertise={metadata.name}.svc.$(LATER):1"
    assert check_k8s.parse_flags(["--a=1", "--b", "2", "--insecure", "--c=", "pos"]) == {
        "a": "1", "b": "2", "insecure": "", "c": ""}
