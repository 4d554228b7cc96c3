"""deploy/: every manifest parses, each embedded pdcluster config validates, and the config
model refuses what cannot run (with the field named)."""
from __future__ import annotations

from pathlib import Path

import pydantic
import pytest
import yaml

from cluster.config import ClusterConfig

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def test_cluster_yaml_validates():
    cfg = ClusterConfig.from_yaml(DEPLOY / "cluster.yaml")
    roles = {p.role: p for p in cfg.pools}
    assert roles["prefill"].resources.accelerator_type != roles["decode"].resources.accelerator_type  # heterogeneous
    assert cfg.hash_page_size == roles["prefill"].engine.page_size


def test_ray_launcher_yaml_is_valid_for_ray_and_has_prefill_and_decode_node_types():
    import json

    import jsonschema
    import ray.autoscaler

    doc = yaml.safe_load((DEPLOY / "ray-cluster.yaml").read_text())
    schema = json.loads((Path(ray.autoscaler.__file__).parent / "ray-schema.json").read_text())
    jsonschema.validate(doc, schema)  # what `ray up` checks first
    types = doc["available_node_types"]
    assert {"prefill", "decode"} <= set(types) and doc["head_node_type"] in types
    mounted = doc["file_mounts"]["/home/ray/cluster.yaml"]  # the pdcluster config the head serves
    cfg = ClusterConfig.from_yaml(DEPLOY.parent / mounted)
    for pool in cfg.pools:  # each pool's custom resource exists on some node type
        for res in pool.resources.custom:
            assert any(res in t["resources"] for t in types.values()), res


def test_kuberay_manifest_and_embedded_config():
    docs = list(yaml.safe_load_all((DEPLOY / "kuberay.yaml").read_text()))
    kinds = {d["kind"]: d for d in docs}
    assert kinds["RayCluster"]["apiVersion"].startswith("ray.io/")
    groups = {g["groupName"] for g in kinds["RayCluster"]["spec"]["workerGroupSpecs"]}
    assert groups == {"prefill", "decode"}
    cfg = ClusterConfig.model_validate(yaml.safe_load(kinds["ConfigMap"]["data"]["cluster.yaml"]))
    assert {p.role for p in cfg.pools} == {"prefill", "decode"}


def test_kuberay_manifest_is_valid_kubernetes():
    """The ConfigMap, and every pod template of the RayCluster (head and worker groups: volumes,
    Secret references, env, ports), against Kubernetes' own schemas (kubernetes-validate,
    strict: unknown fields are errors). KubeRay's CRD fields around them are checked above; its
    CRD schema is not available offline."""
    import kubernetes_validate as kv

    version = kv.latest_version()
    docs = {d["kind"]: d for d in yaml.safe_load_all((DEPLOY / "kuberay.yaml").read_text())}
    kv.validate(docs["ConfigMap"], version, strict=True)
    kv.validate(docs["Service"], version, strict=True)
    spec = docs["RayCluster"]["spec"]
    templates = [spec["headGroupSpec"]["template"]] + [g["template"] for g in spec["workerGroupSpecs"]]
    for t in templates:
        kv.validate({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "check"}, "template": t}, version,
                    strict=True)
    bad = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "check"},
           "template": {**templates[0], "spec": {**templates[0]["spec"], "volumes": [{"name": "x", "secrte": {}}]}}}
    with pytest.raises(kv.ValidationError):  # the validator does catch a misspelt field
        kv.validate(bad, version, strict=True)


def test_kuberay_service_reaches_every_router_on_the_head():
    """router.replicas routers on the head pod, router i on port+i and http_port+i: the head
    container names each port, and the Service in front selects the head pod and maps each."""
    docs = {d["kind"]: d for d in yaml.safe_load_all((DEPLOY / "kuberay.yaml").read_text())}
    r = ClusterConfig.model_validate(yaml.safe_load(docs["ConfigMap"]["data"]["cluster.yaml"])).router
    assert r.replicas >= 2 and r.max_restarts >= 1
    want = {f"grpc-{i}": r.port + i for i in range(r.replicas)} | {f"http-{i}": r.http_port + i
                                                                     for i in range(r.replicas)}
    head = docs["RayCluster"]["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert {p["name"]: p["containerPort"] for p in head["ports"]} == want
    svc = docs["Service"]["spec"]
    assert svc["selector"] == {"ray.io/cluster": docs["RayCluster"]["metadata"]["name"], "ray.io/node-type": "head"}
    assert {p["targetPort"]: p["port"] for p in svc["ports"]} == want


def test_dockerfile_serves():
    text = (DEPLOY / "Dockerfile").read_text()
    assert text.startswith("#") and "FROM python:3.11" in text and "pdcluster" in text and "EXPOSE 50051" in text


@pytest.mark.parametrize("pools, needle", [
    ([{"name": "p", "role": "prefill"}], "decode or colocated"),
    ([{"name": "d", "role": "decode"}], "prefill pool"),
    ([{"name": "a", "role": "colocated"}, {"name": "a", "role": "colocated"}], "unique"),
    ([{"name": "a", "role": "colocated", "replicas": 0}], "replicas"),
    ([{"name": "a", "role": "colocated", "engine": {"page_size": 0}}], "page_size"),
    ([{"name": "a", "role": "colocated", "engine": {"tensor_parallel_size": 0}}], "tensor_parallel_size"),
    ([{"name": "a", "role": "colocated", "resources": {"tp_placement": "ANYWHERE"}}], "tp_placement"),
    ([{"name": "a", "role": "colocated", "engine": {"attention_backend": "fast"}}], "attention_backend"),
    ([{"name": "a", "role": "gpu"}], "role"),
    ([{"name": "a", "role": "colocated", "bogus": 1}], "bogus"),
])
def test_invalid_configs_name_the_field(pools, needle):
    with pytest.raises(pydantic.ValidationError) as err:
        ClusterConfig.model_validate({"pools": pools})
    assert needle in str(err.value)


def test_router_settings_validate():
    with pytest.raises(pydantic.ValidationError, match="policy"):
        ClusterConfig.model_validate({"pools": [{"name": "a", "role": "colocated"}], "router": {"policy": "random"}})
    with pytest.raises(pydantic.ValidationError, match="port"):
        ClusterConfig.model_validate({"pools": [{"name": "a", "role": "colocated"}], "router": {"port": 70000}})


def test_tensor_parallel_size_reaches_the_engine_and_must_divide_the_heads(tiny_model):
    from cluster.config import check_model_fit

    tiny_model("llama")  # 4 attention heads, 2 KV heads
    cfg = ClusterConfig.model_validate({"model": "tiny", "pools": [
        {"name": "a", "role": "colocated", "engine": {"tensor_parallel_size": 2},
         "resources": {"num_cpus": 2.5}}]})
    assert cfg.pools[0].engine.engine_kwargs()["tensor_parallel_size"] == 2
    assert cfg.pools[0].resources.tp_placement == "STRICT_PACK" and cfg.pools[0].resources.threads == 2
    check_model_fit(cfg)  # 2 divides 4 heads
    bad = ClusterConfig.model_validate({"model": "tiny", "pools": [
        {"name": "a", "role": "colocated"}, {"name": "b", "role": "colocated", "engine": {"tensor_parallel_size": 3}}]})
    with pytest.raises(ValueError, match=r"pools\[1\]\.engine\.tensor_parallel_size \(pool 'b'.*num_attention_heads=4"):
        check_model_fit(bad)


def test_a_rank_uses_its_whole_reserved_cpus_as_threads():
    from cluster.config import ResourceShape

    assert [ResourceShape(num_cpus=c).threads for c in (0, 0.5, 1, 1.9, 2, 4)] == [1, 1, 1, 1, 2, 4]
