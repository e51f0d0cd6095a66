#!/usr/bin/env python3
"""Offline checks of everything under deploy/. Run by deploy/validate.sh, which installs the
tools (kustomize, promtool, hadolint) and the Python packages this needs, and passes their paths
in the environment (BR_KUSTOMIZE, BR_PROMTOOL, BR_HADOLINT).

Prints one line per check ("ok ..." or "FAIL ...: why") and, last, "deploy: N passed, M failed".
Exits 1 if any check failed.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import tomllib
import traceback
from pathlib import Path

import jsonschema
import kubernetes_validate
import yaml

DEPLOY = Path(__file__).resolve().parent.parent
K8S = DEPLOY / "k8s"
CONTRACT = DEPLOY / "metrics-contract.txt"
DASHBOARD = DEPLOY / "grafana" / "balanceroute.json"
ALERTS = DEPLOY / "prometheus" / "alerts.yml"
ALERT_TESTS = DEPLOY / "prometheus" / "alerts_test.yml"
PROM_CONFIG = DEPLOY / "prometheus" / "prometheus.yml"
DOCKERFILE = DEPLOY / "docker" / "Dockerfile"
EXAMPLES = sorted((K8S / "examples").glob("*.yaml"))

# kustomize directories to render: (path, must contain these kinds)
TRUST_KINDS = {"Certificate", "Issuer", "NetworkPolicy"}  # mutual TLS and network policies are the default
RENDERS = {
    "base": (K8S / "base", {"StatefulSet", "Deployment", "Service", "PodDisruptionBudget", "ConfigMap"} | TRUST_KINDS),
    "overlays/group-g8": (K8S / "overlays" / "group-g8", {"Namespace", "StatefulSet", "Deployment"} | TRUST_KINDS),
    "overlays/group-g8-monitoring": (K8S / "overlays" / "group-g8-monitoring", {"ServiceMonitor", "PrometheusRule"} | TRUST_KINDS),
    # br-all: the three services in one pod.
    "overlays/all-in-one": (K8S / "overlays" / "all-in-one", {"Namespace", "StatefulSet", "Service", "ConfigMap"} | TRUST_KINDS),
    # group-g8 as the endpoint picker of an InferencePool, with its Gateway and HTTPRoute.
    "overlays/inference-pool": (K8S / "overlays" / "inference-pool",
                                {"Deployment", "InferencePool", "Gateway", "HTTPRoute"} | TRUST_KINDS),
}
# Compositions that no directory spells out: rendered from a generated kustomization in a
# temporary directory. name -> (resources, components, must contain these kinds), paths under k8s/.
COMPOSED = {
    # base with the decision-single-replica component (tests and small setups).
    "base + decision-single-replica":
        (["base"], ["components/decision-single-replica"], {"Deployment"}),
    # Plaintext for clusters whose mesh does mTLS: no certificates, --allow-insecure-remote,
    # HTTP probes and scrapes; the NetworkPolicies stay.
    "group-g8-monitoring + plaintext":
        (["overlays/group-g8-monitoring"], ["components/plaintext"], {"ServiceMonitor", "NetworkPolicy"}),
}
# Kinds a composition must not contain.
COMPOSED_ABSENT = {"group-g8-monitoring + plaintext": {"Certificate", "Issuer"}}
# Pod labels that a service sets on its own pod at run time, so a Service may select them
# although no pod template carries them (none since decision runs active-active).
RUNTIME_LABELS: set[str] = set()

# Kubernetes versions to validate against: the oldest we support (native sidecars in the
# examples need 1.29) and the newest schemas kubernetes-validate ships.
K8S_VERSIONS = ["1.29.0", kubernetes_validate.utils.latest_version()]

# Minimal schema for the one CRD kind we ship (monitoring.coreos.com/v1 ServiceMonitor): the
# fields we use, with their types, and nothing unexpected at the top of an endpoint.
SERVICEMONITOR_SCHEMA = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "$defs": {
        "secretKey": {"type": "object", "required": ["name", "key"], "additionalProperties": False,
                      "properties": {"name": {"type": "string"}, "key": {"type": "string"},
                                     "optional": {"type": "boolean"}}},
        "secretOrConfigMap": {"type": "object", "additionalProperties": False, "maxProperties": 1,
                              "properties": {"secret": {"$ref": "#/$defs/secretKey"},
                                             "configMap": {"$ref": "#/$defs/secretKey"}}},
    },
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "ServiceMonitor"},
        "metadata": {"type": "object", "required": ["name"],
                     "properties": {"name": {"type": "string"}, "namespace": {"type": "string"},
                                    "labels": {"type": "object", "additionalProperties": {"type": "string"}}}},
        "spec": {
            "type": "object",
            "required": ["selector", "endpoints"],
            "additionalProperties": False,
            "properties": {
                "selector": {"type": "object", "properties": {
                    "matchLabels": {"type": "object", "additionalProperties": {"type": "string"}}}},
                "namespaceSelector": {"type": "object"},
                "jobLabel": {"type": "string"},
                "endpoints": {"type": "array", "minItems": 1, "items": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "port": {"type": "string"},
                        "path": {"type": "string"},
                        "scheme": {"enum": ["http", "https"]},
                        "interval": {"type": "string", "pattern": r"^(0|(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"},
                        "scrapeTimeout": {"type": "string", "pattern": r"^(0|(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"},
                        "honorLabels": {"type": "boolean"},
                        "tlsConfig": {"type": "object", "additionalProperties": False, "properties": {
                            "ca": {"$ref": "#/$defs/secretOrConfigMap"},
                            "cert": {"$ref": "#/$defs/secretOrConfigMap"},
                            "keySecret": {"$ref": "#/$defs/secretKey"},
                            "serverName": {"type": "string"},
                            "insecureSkipVerify": {"type": "boolean"}}},
                        "relabelings": {"type": "array", "items": {"type": "object"}},
                        "metricRelabelings": {"type": "array", "items": {"type": "object"}},
                    },
                }},
            },
        },
    },
}
PROMETHEUSRULE_SCHEMA = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "PrometheusRule"},
        "metadata": SERVICEMONITOR_SCHEMA["properties"]["metadata"],
        "spec": {"type": "object", "required": ["groups"], "additionalProperties": False, "properties": {
            "groups": {"type": "array", "minItems": 1, "items": {
                "type": "object", "required": ["name", "rules"], "additionalProperties": False,
                "properties": {"name": {"type": "string"}, "interval": {"type": "string"},
                               "rules": {"type": "array", "items": {
                                   "type": "object", "required": ["expr"], "additionalProperties": False,
                                   "properties": {"alert": {"type": "string"}, "record": {"type": "string"},
                                                  "expr": {"type": ["string", "integer"]}, "for": {"type": "string"},
                                                  "keep_firing_for": {"type": "string"},
                                                  "labels": {"type": "object", "additionalProperties": {"type": "string"}},
                                                  "annotations": {"type": "object", "additionalProperties": {"type": "string"}}}}}}}}}},
    },
}
_STR = {"type": "string"}
_DURATION = {"type": "string", "pattern": r"^([0-9]+(\.[0-9]+)?(ns|us|µs|ms|s|m|h))+$"}
_ISSUER_REF = {"type": "object", "required": ["name"], "additionalProperties": False,
               "properties": {"name": _STR, "kind": {"enum": ["Issuer", "ClusterIssuer"]}, "group": _STR}}
# Minimal schemas of cert-manager.io/v1 Certificate and Issuer: the fields we use, with their
# types and cert-manager's enums (key usages, key algorithms), nothing unknown in spec.
CERTIFICATE_SCHEMA = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "cert-manager.io/v1"},
        "kind": {"const": "Certificate"},
        "metadata": SERVICEMONITOR_SCHEMA["properties"]["metadata"],
        "spec": {
            "type": "object",
            "required": ["secretName", "issuerRef"],
            "anyOf": [{"required": ["uris"]}, {"required": ["dnsNames"]}, {"required": ["commonName"]},
                      {"required": ["ipAddresses"]}, {"required": ["emailAddresses"]}],
            "additionalProperties": False,
            "properties": {
                "secretName": _STR,
                "commonName": _STR,
                "duration": _DURATION,
                "renewBefore": _DURATION,
                "isCA": {"type": "boolean"},
                "uris": {"type": "array", "minItems": 1, "items": {"type": "string", "pattern": r"^[a-z][a-z0-9+.-]*://"}},
                "dnsNames": {"type": "array", "items": _STR},
                "ipAddresses": {"type": "array", "items": _STR},
                "emailAddresses": {"type": "array", "items": _STR},
                "usages": {"type": "array", "items": {"enum": [
                    "signing", "digital signature", "content commitment", "key encipherment",
                    "key agreement", "data encipherment", "cert sign", "crl sign", "encipher only",
                    "decipher only", "any", "server auth", "client auth", "code signing",
                    "email protection", "s/mime", "ipsec end system", "ipsec tunnel", "ipsec user",
                    "timestamping", "ocsp signing", "microsoft sgc", "netscape sgc"]}},
                "privateKey": {"type": "object", "additionalProperties": False, "properties": {
                    "algorithm": {"enum": ["RSA", "ECDSA", "Ed25519"]},
                    "size": {"type": "integer"},
                    "encoding": {"enum": ["PKCS1", "PKCS8"]},
                    "rotationPolicy": {"enum": ["Never", "Always"]}}},
                "secretTemplate": {"type": "object", "additionalProperties": False, "properties": {
                    "labels": {"type": "object", "additionalProperties": _STR},
                    "annotations": {"type": "object", "additionalProperties": _STR}}},
                "issuerRef": _ISSUER_REF,
            },
        },
    },
}
ISSUER_SCHEMA = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "cert-manager.io/v1"},
        "kind": {"const": "Issuer"},
        "metadata": SERVICEMONITOR_SCHEMA["properties"]["metadata"],
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "minProperties": 1,
            "maxProperties": 1,
            "properties": {
                "ca": {"type": "object", "required": ["secretName"], "additionalProperties": False,
                       "properties": {"secretName": _STR,
                                      "crlDistributionPoints": {"type": "array", "items": _STR},
                                      "ocspServers": {"type": "array", "items": _STR}}},
                "selfSigned": {"type": "object", "additionalProperties": False,
                               "properties": {"crlDistributionPoints": {"type": "array", "items": _STR}}},
            },
        },
    },
}

# Minimal schemas of the InferencePool overlay's kinds: inference.networking.k8s.io/v1
# InferencePool (Gateway API Inference Extension, checked against release v1.6.0) and
# gateway.networking.k8s.io/v1 Gateway and HTTPRoute (Gateway API standard channel, checked
# against release v1.6.1). Written here from the v1 API references, not the CRDs' own schemas:
# the fields our objects use and those an edit of the overlay is likely to add (an HTTPS
# listener, hostnames, header matches), with the API's required fields, types, enums and
# bounds. Any field not listed is refused, also one the API has but our objects do not use (add
# it here when they do). The CRDs' CEL rules are not evaluated: check_inference_pool checks by
# hand the ones our objects depend on. The full check is a cluster with the CRDs installed:
# kubectl apply --dry-run=server -k deploy/k8s/overlays/inference-pool
_DNS_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_DNS_SUBDOMAIN = rf"{_DNS_LABEL}(\.{_DNS_LABEL})*"
_PORT = {"type": "integer", "minimum": 1, "maximum": 65535}
_PORT_NUMBER = {"type": "object", "required": ["number"], "additionalProperties": False, "properties": {"number": _PORT}}
_OBJECT_NAME = {"type": "string", "minLength": 1, "maxLength": 253}
_SECTION_NAME = {"type": "string", "minLength": 1, "maxLength": 253, "pattern": rf"^{_DNS_SUBDOMAIN}$"}
_NAMESPACE = {"type": "string", "minLength": 1, "maxLength": 63, "pattern": rf"^{_DNS_LABEL}$"}
_API_GROUP = {"type": "string", "maxLength": 253, "pattern": rf"^$|^{_DNS_SUBDOMAIN}$"}  # "" is the core group
_KIND = {"type": "string", "minLength": 1, "maxLength": 63, "pattern": r"^[a-zA-Z]([-a-zA-Z0-9]*[a-zA-Z0-9])?$"}
_HOSTNAME = {"type": "string", "minLength": 1, "maxLength": 253, "pattern": rf"^(\*\.)?{_DNS_SUBDOMAIN}$"}
_LABEL_VALUE = {"type": "string", "maxLength": 63, "pattern": r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$"}
_LABEL_SELECTOR = {"type": "object", "additionalProperties": False, "properties": {
    "matchLabels": {"type": "object", "additionalProperties": _LABEL_VALUE},
    "matchExpressions": {"type": "array", "items": {
        "type": "object", "required": ["key", "operator"], "additionalProperties": False,
        "properties": {"key": _STR, "operator": {"enum": ["In", "NotIn", "Exists", "DoesNotExist"]},
                       "values": {"type": "array", "items": _STR}}}}}}
_GATEWAY_DURATION = {"type": "string", "pattern": r"^([0-9]{1,5}(h|m|s|ms)){1,4}$"}
_HTTP_TOKEN = {"type": "string", "minLength": 1, "maxLength": 256, "pattern": r"^[A-Za-z0-9!#$%&'*+\-.^_`|~]+$"}
INFERENCEPOOL_SCHEMA = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "inference.networking.k8s.io/v1"},
        "kind": {"const": "InferencePool"},
        "metadata": SERVICEMONITOR_SCHEMA["properties"]["metadata"],
        "spec": {
            "type": "object",
            "required": ["selector", "targetPorts"],
            "additionalProperties": False,
            "properties": {
                # Labels only: a pool's selector has no matchExpressions.
                "selector": {"type": "object", "required": ["matchLabels"], "additionalProperties": False,
                             "properties": {"matchLabels": {"type": "object", "minProperties": 1, "maxProperties": 64,
                                                            "additionalProperties": _LABEL_VALUE}}},
                "targetPorts": {"type": "array", "minItems": 1, "maxItems": 8, "items": _PORT_NUMBER},
                "appProtocol": {"enum": ["http", "kubernetes.io/h2c"]},
                # An object of the pool's own namespace (default kind Service): no namespace field.
                "endpointPickerRef": {"type": "object", "required": ["name"], "additionalProperties": False,
                                      "properties": {"group": _API_GROUP, "kind": _KIND, "name": _OBJECT_NAME,
                                                     "port": _PORT_NUMBER,
                                                     "failureMode": {"enum": ["FailOpen", "FailClose"]}}},
            },
        },
    },
}
_LISTENER = {
    "type": "object",
    "required": ["name", "port", "protocol"],
    "additionalProperties": False,
    "properties": {
        "name": _SECTION_NAME,
        "hostname": _HOSTNAME,
        "port": _PORT,
        # HTTP, HTTPS, TLS, TCP, UDP, or an implementation's own, prefixed by its domain.
        "protocol": {"type": "string", "minLength": 1, "maxLength": 255,
                     "pattern": rf"^[a-zA-Z0-9]([-a-zA-Z0-9]*[a-zA-Z0-9])?$|^{_DNS_SUBDOMAIN}/[A-Za-z0-9]+$"},
        "tls": {"type": "object", "additionalProperties": False, "properties": {
            "mode": {"enum": ["Terminate", "Passthrough"]},
            "certificateRefs": {"type": "array", "maxItems": 64, "items": {
                "type": "object", "required": ["name"], "additionalProperties": False,
                "properties": {"group": _API_GROUP, "kind": _KIND, "name": _OBJECT_NAME, "namespace": _NAMESPACE}}},
            "options": {"type": "object", "additionalProperties": {"type": "string", "maxLength": 4096}}}},
        "allowedRoutes": {"type": "object", "additionalProperties": False, "properties": {
            "namespaces": {"type": "object", "additionalProperties": False, "properties": {
                "from": {"enum": ["All", "Selector", "Same"]}, "selector": _LABEL_SELECTOR}},
            "kinds": {"type": "array", "maxItems": 8, "items": {
                "type": "object", "required": ["kind"], "additionalProperties": False,
                "properties": {"group": _API_GROUP, "kind": _KIND}}}}},
    },
}
GATEWAY_SCHEMA = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "gateway.networking.k8s.io/v1"},
        "kind": {"const": "Gateway"},
        "metadata": SERVICEMONITOR_SCHEMA["properties"]["metadata"],
        "spec": {
            "type": "object",
            "required": ["gatewayClassName", "listeners"],
            "additionalProperties": False,
            "properties": {
                "gatewayClassName": _OBJECT_NAME,
                "listeners": {"type": "array", "minItems": 1, "maxItems": 64, "items": _LISTENER},
                "infrastructure": {"type": "object", "additionalProperties": False, "properties": {
                    "labels": {"type": "object", "maxProperties": 8, "additionalProperties": _LABEL_VALUE},
                    "annotations": {"type": "object", "maxProperties": 16,
                                    "additionalProperties": {"type": "string", "maxLength": 4096}},
                    "parametersRef": {"type": "object", "required": ["group", "kind", "name"], "additionalProperties": False,
                                      "properties": {"group": _API_GROUP, "kind": _KIND, "name": _OBJECT_NAME}}}},
            },
        },
    },
}
_HTTP_MATCH_VALUE = {"type": "object", "required": ["name", "value"], "additionalProperties": False,
                     "properties": {"type": {"enum": ["Exact", "RegularExpression"]}, "name": _HTTP_TOKEN,
                                    "value": {"type": "string", "minLength": 1, "maxLength": 4096}}}
HTTPROUTE_SCHEMA = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "gateway.networking.k8s.io/v1"},
        "kind": {"const": "HTTPRoute"},
        "metadata": SERVICEMONITOR_SCHEMA["properties"]["metadata"],
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                "parentRefs": {"type": "array", "maxItems": 32, "items": {
                    "type": "object", "required": ["name"], "additionalProperties": False,
                    "properties": {"group": _API_GROUP, "kind": _KIND, "namespace": _NAMESPACE, "name": _OBJECT_NAME,
                                   "sectionName": _SECTION_NAME, "port": _PORT}}},
                "hostnames": {"type": "array", "maxItems": 16, "items": _HOSTNAME},
                "rules": {"type": "array", "minItems": 1, "maxItems": 16, "items": {
                    "type": "object", "additionalProperties": False, "properties": {
                        "name": _SECTION_NAME,
                        "matches": {"type": "array", "maxItems": 64, "items": {
                            "type": "object", "additionalProperties": False, "properties": {
                                "path": {"type": "object", "additionalProperties": False, "properties": {
                                    "type": {"enum": ["Exact", "PathPrefix", "RegularExpression"]},
                                    "value": {"type": "string", "maxLength": 1024}}},
                                "headers": {"type": "array", "maxItems": 16, "items": _HTTP_MATCH_VALUE},
                                "queryParams": {"type": "array", "maxItems": 16, "items": _HTTP_MATCH_VALUE},
                                "method": {"enum": ["GET", "HEAD", "POST", "PUT", "DELETE", "CONNECT", "OPTIONS",
                                                    "TRACE", "PATCH"]}}}},
                        "backendRefs": {"type": "array", "maxItems": 16, "items": {
                            "type": "object", "required": ["name"], "additionalProperties": False,
                            "properties": {"group": _API_GROUP, "kind": _KIND, "namespace": _NAMESPACE,
                                           "name": _OBJECT_NAME, "port": _PORT,
                                           "weight": {"type": "integer", "minimum": 0, "maximum": 1000000}}}},
                        "timeouts": {"type": "object", "additionalProperties": False,
                                     "properties": {"request": _GATEWAY_DURATION, "backendRequest": _GATEWAY_DURATION}}}}},
            },
        },
    },
}
CRD_SCHEMAS = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"): SERVICEMONITOR_SCHEMA,
    ("monitoring.coreos.com/v1", "PrometheusRule"): PROMETHEUSRULE_SCHEMA,
    ("cert-manager.io/v1", "Certificate"): CERTIFICATE_SCHEMA,
    ("cert-manager.io/v1", "Issuer"): ISSUER_SCHEMA,
    ("inference.networking.k8s.io/v1", "InferencePool"): INFERENCEPOOL_SCHEMA,
    ("gateway.networking.k8s.io/v1", "Gateway"): GATEWAY_SCHEMA,
    ("gateway.networking.k8s.io/v1", "HTTPRoute"): HTTPROUTE_SCHEMA,
}

WORKLOAD_KINDS = {"Deployment", "StatefulSet", "DaemonSet", "ReplicaSet"}

class Checks:
    def __init__(self) -> None:
        self.passed = 0
        self.failed = 0

    def run(self, name: str, fn, *args) -> object:
        try:
            result = fn(*args)
        except AssertionError as e:
            self.failed += 1
            print(f"FAIL {name}: {e}", flush=True)
            return None
        except Exception as e:  # a crash in a check is a failed check, with its trace
            self.failed += 1
            print(f"FAIL {name}: {type(e).__name__}: {e}", flush=True)
            traceback.print_exc(limit=3)
            return None
        self.passed += 1
        note = f" ({result})" if isinstance(result, str) and result else ""
        print(f"ok   {name}{note}", flush=True)
        return result


# ---------------------------------------------------------------- kubernetes manifests

def render(path: Path) -> list[dict]:
    kustomize = os.environ["BR_KUSTOMIZE"]
    out = subprocess.run([kustomize, "build", str(path)], capture_output=True, text=True)
    assert out.returncode == 0, f"kustomize build failed: {out.stderr.strip()}"
    warnings = [l for l in out.stderr.splitlines() if l.strip()]
    assert not warnings, f"kustomize warned: {warnings}"
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def render_composed(resources: list[str], components: list[str]) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        rel = os.path.relpath(K8S, tmp)  # kustomize wants relative paths
        doc = {"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
               "resources": [f"{rel}/{r}" for r in resources],
               "components": [f"{rel}/{c}" for c in components]}
        Path(tmp, "kustomization.yaml").write_text(yaml.safe_dump(doc))
        return render(Path(tmp))


def decision_is_single(objs: list[dict]) -> bool:
    dep = [o for o in objs if o["kind"] == "Deployment" and o["metadata"]["name"] == "decision"]
    return bool(dep) and dep[0]["spec"].get("replicas", 1) == 1


def check_decision_routing(objs: list[dict], single: bool) -> str:
    """Assign reaches every ready replica by one headless name (active-active: the gateway's
    client picks a replica per call and fails over), and a PDB keeps one replica up."""
    svc = next(o for o in objs if o["kind"] == "Service" and o["metadata"]["name"] == "decision")
    dep = next(o for o in objs if o["kind"] == "Deployment" and o["metadata"]["name"] == "decision")
    assert "balanceroute.io/decision-role" not in svc["spec"]["selector"], \
        "active-active: the decision Service selects every replica, not an elected one"
    assert svc["spec"].get("clusterIP") == "None", \
        "the decision Service must be headless, so the gateway resolves every replica"
    assert not any(p["name"] == "admin" for p in svc["spec"]["ports"]), \
        "the Assign Service must not carry the admin port"
    admin = [o for o in objs if o["kind"] == "Service" and o["metadata"]["name"] == "decision-admin"]
    assert admin, "decision-admin must reach every replica"
    if single:
        return "1 replica"
    assert dep["spec"]["replicas"] >= 2, "want two or more active-active replicas"
    labels = pod_labels(dep)
    pdbs = [o for o in objs if o["kind"] == "PodDisruptionBudget"
            and selects(o["spec"].get("selector", {}).get("matchLabels", {}), labels)]
    assert pdbs and pdbs[0]["spec"].get("minAvailable") == 1, \
        "a PodDisruptionBudget with minAvailable 1 must cover the decision replicas"
    return f"{dep['spec']['replicas']} active-active replicas"


def load_yaml_docs(path: Path) -> list[dict]:
    with path.open() as f:
        return [d for d in yaml.safe_load_all(f) if d]


def obj_id(o: dict) -> str:
    md = o.get("metadata", {})
    ns = md.get("namespace")
    return f"{o.get('kind')}/{(ns + '/') if ns else ''}{md.get('name')}"


def schema_validate(o: dict) -> str:
    key = (o.get("apiVersion"), o.get("kind"))
    if key in CRD_SCHEMAS:
        schema = CRD_SCHEMAS[key]
        errors = sorted(jsonschema.validators.validator_for(schema)(schema).iter_errors(o),
                        key=lambda e: list(map(str, e.absolute_path)))
        assert not errors, "; ".join(
            f"{obj_id(o)}: {'.'.join(map(str, e.absolute_path)) or '(top)'}: {e.message}" for e in errors)
        return "CRD, minimal schema"
    for v in K8S_VERSIONS:
        try:
            kubernetes_validate.validate(o, v, strict=True)
        except kubernetes_validate.ValidationError as e:
            path = "/".join(str(p) for p in e.path)
            raise AssertionError(f"k8s {v}: {path}: {e.message}") from None
        except kubernetes_validate.SchemaNotFoundError:
            raise AssertionError(f"no schema for {key} in Kubernetes {v}") from None
    return ""


def pod_spec(o: dict) -> dict | None:
    if o.get("kind") in WORKLOAD_KINDS:
        return o["spec"]["template"]["spec"]
    return None


def pod_labels(o: dict) -> dict:
    return o["spec"]["template"].get("metadata", {}).get("labels", {}) or {}


def all_containers(spec: dict) -> list[dict]:
    return list(spec.get("initContainers", [])) + list(spec.get("containers", []))


def selects(selector: dict, labels: dict) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def check_consistency(objs: list[dict], strict_security: bool) -> str:
    """Cross-object checks that the schemas cannot express."""
    problems: list[str] = []
    by_kind: dict[str, list[dict]] = {}
    for o in objs:
        by_kind.setdefault(o["kind"], []).append(o)
    workloads = [o for o in objs if o["kind"] in WORKLOAD_KINDS]
    names = {(o["kind"], o["metadata"]["name"]) for o in objs}
    ids = [obj_id(o) for o in objs]
    dups = {i for i in ids if ids.count(i) > 1}
    if dups:
        problems.append(f"duplicate objects {sorted(dups)}")

    for w in workloads:
        wid = obj_id(w)
        spec = pod_spec(w)
        labels = pod_labels(w)
        sel = w["spec"].get("selector", {}).get("matchLabels", {})
        if not selects(sel, labels):
            problems.append(f"{wid}: selector {sel} does not match its pod labels")
        ports = {p["name"]: p["containerPort"] for c in all_containers(spec) for p in c.get("ports", []) if "name" in p}
        for c in all_containers(spec):
            cname = f"{wid}/{c['name']}"
            for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
                pr = c.get(probe)
                if not pr:
                    continue
                port = (pr.get("httpGet") or pr.get("tcpSocket") or pr.get("grpc") or {}).get("port")
                if isinstance(port, str) and port not in ports:
                    problems.append(f"{cname}: {probe} uses unknown port name {port!r}")
            if strict_security or c["name"].startswith("br-") or c.get("image", "").split("/")[-1].startswith("br-"):
                sc = c.get("securityContext", {})
                if sc.get("readOnlyRootFilesystem") is not True:
                    problems.append(f"{cname}: readOnlyRootFilesystem must be true")
                if sc.get("allowPrivilegeEscalation") is not False:
                    problems.append(f"{cname}: allowPrivilegeEscalation must be false")
                if "ALL" not in sc.get("capabilities", {}).get("drop", []):
                    problems.append(f"{cname}: capabilities must drop ALL")
                run_as_non_root = sc.get("runAsNonRoot", spec.get("securityContext", {}).get("runAsNonRoot"))
                if run_as_non_root is not True:
                    problems.append(f"{cname}: runAsNonRoot must be true")
                res = c.get("resources", {})
                for part in ("requests", "limits"):
                    for r in ("cpu", "memory"):
                        if r not in res.get(part, {}):
                            problems.append(f"{cname}: resources.{part}.{r} missing")
                for probe in ("readinessProbe", "livenessProbe"):
                    if probe not in c:
                        problems.append(f"{cname}: {probe} missing")
                for probe, path in (("readinessProbe", "/readyz"), ("livenessProbe", "/livez")):
                    got = c.get(probe, {}).get("httpGet", {})
                    if got and (got.get("path") != path or got.get("port") not in ("admin", "shim-admin")):
                        problems.append(f"{cname}: {probe} must be GET {path} on the admin port, got {got}")
        # scrape annotations point at a declared admin port
        ann = w["spec"]["template"].get("metadata", {}).get("annotations", {}) or {}
        if ann.get("prometheus.io/scrape") == "true":
            port = ann.get("prometheus.io/port")
            if not port or int(port) not in ports.values():
                problems.append(f"{wid}: prometheus.io/port {port!r} is not a container port")
            admin = [v for k, v in ports.items() if k in ("admin", "shim-admin")]
            if admin and int(port or 0) not in admin:
                problems.append(f"{wid}: prometheus.io/port {port} is not the admin port {admin}")
        # referenced ConfigMaps, ServiceAccounts exist in the same render
        for v in spec.get("volumes", []):
            cm = v.get("configMap", {}).get("name")
            if cm and ("ConfigMap", cm) not in names:
                problems.append(f"{wid}: volume {v['name']} references missing ConfigMap {cm}")
        sa = spec.get("serviceAccountName")
        if sa and ("ServiceAccount", sa) not in names:
            problems.append(f"{wid}: missing ServiceAccount {sa}")
        if w["kind"] == "StatefulSet":
            svc = w["spec"].get("serviceName")
            match = [s for s in by_kind.get("Service", []) if s["metadata"]["name"] == svc]
            if not match:
                problems.append(f"{wid}: governing Service {svc} missing")
            elif match[0]["spec"].get("clusterIP") != "None":
                problems.append(f"{wid}: governing Service {svc} is not headless")

    for s in by_kind.get("Service", []):
        sid = obj_id(s)
        sel = {k: v for k, v in s["spec"].get("selector", {}).items() if k not in RUNTIME_LABELS}
        targets = [w for w in workloads if selects(sel, pod_labels(w))]
        if not targets:
            problems.append(f"{sid}: selector {sel} matches no workload")
            continue
        for p in s["spec"].get("ports", []):
            tp = p.get("targetPort", p.get("port"))
            for w in targets:
                ports = {q.get("name"): q["containerPort"] for c in all_containers(pod_spec(w)) for q in c.get("ports", [])}
                if isinstance(tp, str) and tp not in ports:
                    problems.append(f"{sid}: targetPort {tp!r} is not a named port of {obj_id(w)}")
                if isinstance(tp, int) and tp not in ports.values():
                    problems.append(f"{sid}: targetPort {tp} is not a port of {obj_id(w)}")

    for pdb in by_kind.get("PodDisruptionBudget", []):
        sel = pdb["spec"].get("selector", {}).get("matchLabels", {})
        if not any(selects(sel, pod_labels(w)) for w in workloads):
            problems.append(f"{obj_id(pdb)}: selector {sel} matches no workload")

    for rb in by_kind.get("RoleBinding", []):
        if ("Role", rb["roleRef"]["name"]) not in names and rb["roleRef"]["kind"] == "Role":
            problems.append(f"{obj_id(rb)}: missing Role {rb['roleRef']['name']}")
        for subj in rb.get("subjects", []):
            if subj["kind"] == "ServiceAccount" and ("ServiceAccount", subj["name"]) not in names:
                problems.append(f"{obj_id(rb)}: missing ServiceAccount {subj['name']}")

    for sm in by_kind.get("ServiceMonitor", []):
        sel = sm["spec"]["selector"].get("matchLabels", {})
        svcs = [s for s in by_kind.get("Service", []) if selects(sel, s["metadata"].get("labels", {}))]
        if not svcs:
            problems.append(f"{obj_id(sm)}: selects no Service")
        for ep in sm["spec"]["endpoints"]:
            if not any(p.get("name") == ep.get("port") for s in svcs for p in s["spec"]["ports"]):
                problems.append(f"{obj_id(sm)}: endpoint port {ep.get('port')!r} is on no selected Service")

    namespaces = {o["metadata"].get("namespace") for o in objs if o["kind"] != "Namespace"}
    if len(namespaces) != 1:
        problems.append(f"objects spread over namespaces {sorted(map(str, namespaces))}; expected one")

    assert not problems, "; ".join(problems)
    return f"{len(objs)} objects, {len(workloads)} workloads"


# ---------------------------------------------------------------- trust (mutual TLS)

TLS_ENV = {"BALANCEROUTE_TLS_CERT": "tls.crt", "BALANCEROUTE_TLS_KEY": "tls.key", "BALANCEROUTE_TLS_CA": "ca.crt"}
DEFAULT_TRUST_DOMAIN = "balanceroute.local"
ADMIN_PORT_NAMES = ("admin", "shim-admin")


def is_balanceroute(c: dict) -> bool:
    return c["name"].startswith("br-") or c.get("image", "").split("/")[-1].startswith("br-")


def br_role(c: dict) -> str:
    """The role a BalanceRoute container runs as (its binary's name; the shim is a worker)."""
    base = c["name"] if c["name"].startswith("br-") else c.get("image", "").split("/")[-1]
    role = base.removeprefix("br-").split(":")[0]
    return "worker" if role == "shim" else role


def env_values(c: dict) -> dict[str, str | None]:
    return {e["name"]: e.get("value") for e in c.get("env", [])}


def spiffe_prefix(c: dict, role: str) -> str:
    env = env_values(c)
    td = env.get("BALANCEROUTE_TRUST_DOMAIN") or DEFAULT_TRUST_DOMAIN
    if role == "worker":
        return f"spiffe://{td}/br/worker/{env.get('BALANCEROUTE_GROUP')}/"
    return f"spiffe://{td}/br/{role}"


def secret_files(spec: dict, c: dict, path: str) -> tuple[list[tuple[str, str, str]], str | None]:
    """The (Secret, key, projected path) pairs a file path of container `c` can resolve to, or
    why it resolves to none. `$(VAR)` in the path (a per-pod value) matches any path part."""
    mounts = sorted(c.get("volumeMounts", []), key=lambda m: -len(m["mountPath"]))
    m = next((m for m in mounts if path.startswith(m["mountPath"].rstrip("/") + "/")), None)
    if m is None:
        return [], f"{path} is on no volume mount"
    if m.get("subPath") or m.get("subPathExpr"):
        return [], f"{path}: mount {m['mountPath']} uses subPath, which never sees a renewed certificate"
    rel = path[len(m["mountPath"].rstrip("/")) + 1:]
    pattern = re.compile("^" + re.sub(r"\\\$\\\([A-Za-z_][A-Za-z0-9_]*\\\)", "[^/]+", re.escape(rel)) + "$")
    vol = next((v for v in spec.get("volumes", []) if v["name"] == m["name"]), None)
    if vol is None:
        return [], f"{path}: volume {m['name']} missing"
    sources = []
    if "secret" in vol:
        sources = [vol["secret"] | {"name": vol["secret"].get("secretName")}]
    elif "projected" in vol:
        sources = [src["secret"] for src in vol["projected"].get("sources", []) if "secret" in src]
    else:
        return [], f"{path}: volume {m['name']} is not a Secret"
    out = []
    for src in sources:
        items = src.get("items") or [{"key": k, "path": k} for k in TLS_ENV.values()]
        out += [(src["name"], it["key"], it["path"]) for it in items if pattern.match(it["path"])]
    return out, (None if out else f"{path}: no Secret key of volume {m['name']} is projected there")


def check_trust(objs: list[dict], strict: bool) -> str:
    """Every BalanceRoute container either runs mutual TLS with a certificate cert-manager
    issues for its role, or serves plaintext on loopback or with --allow-insecure-remote;
    admin probes and scrape annotations follow the scheme; the ServiceMonitor scrapes TLS
    ports with an admin certificate. `strict`: the Issuers must be in the same objects (the
    examples rely on the control plane's)."""
    problems: list[str] = []
    certs = {c["spec"]["secretName"]: c for c in objs if c["kind"] == "Certificate"}
    issuers = {o["metadata"]["name"] for o in objs if o["kind"] == "Issuer"}
    tls_pods = plain_pods = 0
    tls_workloads = []
    for w in (o for o in objs if o["kind"] in WORKLOAD_KINDS):
        spec, wid = pod_spec(w), obj_id(w)
        ann = w["spec"]["template"].get("metadata", {}).get("annotations", {}) or {}
        for c in (c for c in all_containers(spec) if is_balanceroute(c)):
            cname, env, role = f"{wid}/{c['name']}", env_values(c), br_role(c)
            given = [k for k in TLS_ENV if k in env]
            tls = bool(given)
            if tls and len(given) != len(TLS_ENV):
                problems.append(f"{cname}: sets {given} but all of {sorted(TLS_ENV)} or none are needed")
            if tls:
                tls_pods += 1
                tls_workloads.append(w)
                want = spiffe_prefix(c, role)
                for var, key in TLS_ENV.items():
                    if var not in env:
                        continue
                    found, why = secret_files(spec, c, env[var] or "")
                    if why:
                        problems.append(f"{cname}: {var}: {why}")
                    for secret, got_key, item_path in found:
                        if got_key != key:
                            problems.append(f"{cname}: {var} reads key {got_key} of Secret {secret}, want {key}")
                        cert = certs.get(secret)
                        if cert is None:
                            problems.append(f"{cname}: Secret {secret} is produced by no Certificate")
                            continue
                        uris = cert["spec"].get("uris", [])
                        ok = [u for u in uris if (u.startswith(want) if role == "worker" else u == want)]
                        if not ok:
                            problems.append(f"{cname}: Certificate {cert['metadata']['name']} has uris {uris}, none is {want}{'<id>' if role == 'worker' else ''}")
                        rank = item_path.split("/")[0]
                        if role == "worker" and rank.isdigit() and not any(u == f"{want}{rank}" for u in uris):
                            problems.append(f"{cname}: {item_path} of Secret {secret} is not worker {want}{rank}")
                        usages = set(cert["spec"].get("usages", []))
                        if not {"server auth", "client auth"} <= usages:
                            problems.append(f"{obj_id(cert)}: usages {sorted(usages)} lack server auth + client auth")
            else:
                plain_pods += 1
                for var in ("BALANCEROUTE_LISTEN", "BALANCEROUTE_ADMIN_LISTEN"):
                    host = (env.get(var) or "127.0.0.1:0").rsplit(":", 1)[0].strip("[]")
                    if host not in ("127.0.0.1", "::1", "localhost") \
                            and env.get("BALANCEROUTE_ALLOW_INSECURE_REMOTE") != "true":
                        problems.append(f"{cname}: {var}={env.get(var)} without TLS is refused at start "
                                        "(set the TLS variables or BALANCEROUTE_ALLOW_INSECURE_REMOTE=true)")
            want_scheme = "HTTPS" if tls else "HTTP"
            for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
                get = (c.get(probe) or {}).get("httpGet")
                if get and get.get("port") in ADMIN_PORT_NAMES and get.get("scheme", "HTTP") != want_scheme:
                    problems.append(f"{cname}: {probe} on the admin port must use scheme {want_scheme}")
            if ann.get("prometheus.io/scrape") == "true" and ann.get("prometheus.io/scheme", "http") != want_scheme.lower():
                problems.append(f"{wid}: annotation prometheus.io/scheme must be {want_scheme.lower()}")
    for cert in certs.values():
        ref = cert["spec"]["issuerRef"]
        if ref.get("kind", "Issuer") == "Issuer" and ref["name"] not in issuers and (strict or issuers):
            problems.append(f"{obj_id(cert)}: Issuer {ref['name']} missing")
    for sm in (o for o in objs if o["kind"] == "ServiceMonitor"):
        sel = sm["spec"]["selector"].get("matchLabels", {})
        svcs = [s for s in objs if s["kind"] == "Service" and selects(sel, s["metadata"].get("labels", {}))]
        behind = [w for w in tls_workloads for s in svcs
                  if selects({k: v for k, v in s["spec"].get("selector", {}).items() if k not in RUNTIME_LABELS}, pod_labels(w))]
        for ep in sm["spec"]["endpoints"]:
            tc = ep.get("tlsConfig", {})
            if not behind:
                if ep.get("scheme") == "https":
                    problems.append(f"{obj_id(sm)}: scrapes https but the pods serve plaintext")
                continue
            if ep.get("scheme") != "https":
                problems.append(f"{obj_id(sm)}: endpoint {ep.get('port')} must scrape with scheme https")
            secret = tc.get("keySecret", {}).get("name")
            if secret != tc.get("cert", {}).get("secret", {}).get("name"):
                problems.append(f"{obj_id(sm)}: tlsConfig cert and keySecret must be one Secret")
            cert = certs.get(secret)
            td = DEFAULT_TRUST_DOMAIN
            if cert is None or f"spiffe://{td}/br/admin" not in cert["spec"].get("uris", []):
                problems.append(f"{obj_id(sm)}: tlsConfig Secret {secret} is not produced by a Certificate of role admin")
            name = tc.get("serverName")
            for s_ in (certs.values() if ep.get("scheme") == "https" else []):
                if "server auth" in s_["spec"].get("usages", []) and name not in s_["spec"].get("dnsNames", []):
                    problems.append(f"{obj_id(sm)}: serverName {name!r} is not a DNS name of {obj_id(s_)}")
    assert not problems, "; ".join(dict.fromkeys(problems))
    return f"{tls_pods} containers on mutual TLS, {plain_pods} plaintext, {len(certs)} Certificates"


def label_selector_matches(sel: dict, labels: dict) -> bool:
    """A LabelSelector (matchLabels and matchExpressions); an empty one selects everything."""
    if any(labels.get(k) != v for k, v in (sel.get("matchLabels") or {}).items() if k not in RUNTIME_LABELS):
        return False
    for e in sel.get("matchExpressions") or []:
        has, val, vals = e["key"] in labels, labels.get(e["key"]), e.get("values", [])
        op = e["operator"]
        if (op == "In" and val not in vals) or (op == "NotIn" and has and val in vals) \
                or (op == "Exists" and not has) or (op == "DoesNotExist" and has):
            return False
    return True


def find(objs: list[dict], kind: str, name: str) -> dict:
    """The object of `kind` named `name` (the self-tests' mutations pick their target so)."""
    return next(o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name)


def container_ports(w: dict) -> dict:
    """A workload's container ports by name (`None` for unnamed ones)."""
    return {p.get("name"): p["containerPort"] for c in all_containers(pod_spec(w)) for p in c.get("ports", [])}


def check_network_policies(objs: list[dict], strict: bool) -> str:
    """Every NetworkPolicy selects pods that exist, its same-namespace peers are pods that
    exist, its named ports are ports of the selected pods; with `strict` (a whole namespace),
    ingress is denied by default and every port a Service exposes is admitted by some policy."""
    problems: list[str] = []
    pols = [o for o in objs if o["kind"] == "NetworkPolicy"]
    workloads = [o for o in objs if o["kind"] in WORKLOAD_KINDS]
    if not pols:
        assert not strict, "no NetworkPolicy rendered"
        return "none"

    for pol in pols:
        pid = obj_id(pol)
        targets = [w for w in workloads if label_selector_matches(pol["spec"]["podSelector"], pod_labels(w))]
        if not targets:
            problems.append(f"{pid}: podSelector {pol['spec']['podSelector']} selects no pod")
        if "Ingress" not in pol["spec"].get("policyTypes", ["Ingress"]):
            continue
        for rule in pol["spec"].get("ingress", []):
            for port in rule.get("ports", []):
                p = port.get("port")
                if p is not None and not any((p in container_ports(w)) if isinstance(p, str) else (p in container_ports(w).values()) for w in targets):
                    problems.append(f"{pid}: port {p!r} is no port of the pods it selects")
            for peer in rule.get("from", []):
                if "podSelector" in peer and "namespaceSelector" not in peer \
                        and not any(label_selector_matches(peer["podSelector"], pod_labels(w)) for w in workloads):
                    problems.append(f"{pid}: peer podSelector {peer['podSelector']} selects no pod of this namespace")
    if strict:
        if not any(p["spec"]["podSelector"] == {} and not p["spec"].get("ingress")
                   and "Ingress" in p["spec"].get("policyTypes", []) for p in pols):
            problems.append("no default-deny ingress NetworkPolicy (podSelector {}, policyTypes [Ingress], no rules)")
        for svc in (o for o in objs if o["kind"] == "Service"):
            sel = {k: v for k, v in svc["spec"].get("selector", {}).items() if k not in RUNTIME_LABELS}
            for w in (w for w in workloads if selects(sel, pod_labels(w))):
                for sp in svc["spec"].get("ports", []):
                    tp = sp.get("targetPort", sp.get("port"))
                    num = container_ports(w).get(tp, tp)
                    name = tp if isinstance(tp, str) else next((k for k, v in container_ports(w).items() if v == tp), None)
                    admitted = any(
                        any(not r.get("ports") or any(q.get("port") in (name, num) for q in r["ports"])
                            for r in p["spec"].get("ingress", []))
                        for p in pols if label_selector_matches(p["spec"]["podSelector"], pod_labels(w)))
                    if not admitted:
                        problems.append(f"{obj_id(svc)}: port {sp.get('name')} of {obj_id(w)} is admitted by no NetworkPolicy")
    assert not problems, "; ".join(sorted(set(problems)))
    return f"{len(pols)} NetworkPolicies"


def check_trust_selftest(objs: list[dict], example: list[dict]) -> str:
    """The trust and network-policy checks catch what they are meant to catch: each mutation of
    a passing render (group-g8-monitoring) or of the vLLM example must fail them."""
    import copy

    def container(os_, kind, name):
        return pod_spec(find(os_, kind, name))["containers"][0]

    def wrong_role(os_):
        find(os_, "Certificate", "snapshot-tls")["spec"]["uris"] = ["spiffe://balanceroute.local/br/ingest"]

    def http_probe(os_):
        container(os_, "Deployment", "ingest")["readinessProbe"]["httpGet"].pop("scheme")

    def no_tls_no_allow(os_):
        c = container(os_, "Deployment", "decision")
        c["env"] = [e for e in c["env"] if e["name"] not in TLS_ENV]

    def no_certificate(os_):
        os_.remove(find(os_, "Certificate", "decision-tls"))

    def subpath(os_):
        m = next(m for m in container(os_, "StatefulSet", "snapshot")["volumeMounts"] if m["name"] == "tls")
        m["subPath"] = "tls.crt"

    def plain_scrape(os_):
        ep = find(os_, "ServiceMonitor", "balanceroute")["spec"]["endpoints"][0]
        ep.pop("tlsConfig")
        ep["scheme"] = "http"

    def ghost_selector(os_):
        find(os_, "NetworkPolicy", "snapshot")["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/component"] = "snap"

    def no_default_deny(os_):
        os_.remove(find(os_, "NetworkPolicy", "default-deny-ingress"))

    def decision_unreachable(os_):
        os_.remove(find(os_, "NetworkPolicy", "decision"))

    def bad_port(os_):
        find(os_, "NetworkPolicy", "ingest")["spec"]["ingress"][0]["ports"][0]["port"] = "grcp"

    def swapped_rank(os_):
        vol = next(v for v in pod_spec(find(os_, "StatefulSet", "vllm-decode"))["volumes"] if v["name"] == "worker-tls")
        vol["projected"]["sources"][3]["secret"]["name"] = "worker-g8-4-tls"

    cases = [(objs, f, check) for f, check in [
        (wrong_role, check_trust), (http_probe, check_trust), (no_tls_no_allow, check_trust),
        (no_certificate, check_trust), (subpath, check_trust), (plain_scrape, check_trust),
        (ghost_selector, check_network_policies), (no_default_deny, check_network_policies),
        (decision_unreachable, check_network_policies), (bad_port, check_network_policies)]]
    cases.append((example, swapped_rank, check_trust))
    for base, mutate, check in cases:
        check(base, True)  # the unmutated objects pass
        mutated = copy.deepcopy(base)
        mutate(mutated)
        try:
            check(mutated, True)
        except AssertionError:
            continue
        raise AssertionError(f"{check.__name__} passed the mutation {mutate.__name__}")
    return f"{len(cases)} mutations caught"


# ---------------------------------------------------------------- InferencePool, Gateway, HTTPRoute

INFERENCE_GROUP = "inference.networking.k8s.io"
GATEWAY_GROUP = "gateway.networking.k8s.io"


def listen_port(value: str | None) -> int | None:
    """The port of a BALANCEROUTE_*_LISTEN address (host:port), or None."""
    port = (value or "").rsplit(":", 1)[-1]
    return int(port) if port.isdigit() else None


def admitted(objs: list[dict], peer_labels: dict, pods: list[dict], port: int) -> bool:
    """Whether some NetworkPolicy selecting `pods` admits a pod with `peer_labels` (any
    namespace) to container port `port` of each of them."""
    def ok(w: dict) -> bool:
        names = container_ports(w)
        for pol in (o for o in objs if o["kind"] == "NetworkPolicy"):
            if not label_selector_matches(pol["spec"]["podSelector"], pod_labels(w)):
                continue
            for rule in pol["spec"].get("ingress", []):
                ports = [names.get(q.get("port"), q.get("port")) for q in rule.get("ports", [])]
                peers = rule.get("from", [])
                if (not ports or port in ports) and (not peers or any(
                        "podSelector" in p and label_selector_matches(p["podSelector"], peer_labels) for p in peers)):
                    return True
        return False
    return all(ok(w) for w in pods)


def gateways_of(pool: dict, gateways: list[dict], routes: list[dict]) -> list[dict]:
    """The Gateways some HTTPRoute attaches to with the pool as a backend (same namespace)."""
    ns = pool["metadata"].get("namespace")
    names = {p.get("name") for r in routes if r["metadata"].get("namespace") == ns
             for rule in r["spec"].get("rules", []) for b in rule.get("backendRefs", [])
             if (b.get("group"), b.get("kind"), b.get("name")) == (INFERENCE_GROUP, "InferencePool", pool["metadata"]["name"])
             for p in r["spec"].get("parentRefs", [])}
    return [g for g in gateways if g["metadata"]["name"] in names and g["metadata"].get("namespace") == ns]


def check_inference_pool(objs: list[dict]) -> str:
    """The InferencePool, its Gateway and HTTPRoute against the control plane and the decode
    pods (the overlay's render plus the vLLM example): what the schemas cannot say, and the
    CRDs' CEL rules our objects depend on (the minimal schemas have no CEL)."""
    problems: list[str] = []
    pools = [o for o in objs if o["kind"] == "InferencePool"]
    gateways = [o for o in objs if o["kind"] == "Gateway"]
    routes = [o for o in objs if o["kind"] == "HTTPRoute"]
    workloads = [o for o in objs if o["kind"] in WORKLOAD_KINDS]
    assert pools, "no InferencePool"

    def ns(o: dict) -> str | None:
        return o["metadata"].get("namespace")

    for pool in pools:
        pid, spec = obj_id(pool), pool.get("spec", {})
        targets = [t.get("number") for t in spec.get("targetPorts", [])]
        # CEL (targetPorts): port number must be unique.
        if len(targets) != len(set(targets)):
            problems.append(f"{pid}: spec.targetPorts {targets}: port numbers must be unique")
        sel = (spec.get("selector") or {}).get("matchLabels") or {}
        pods = [w for w in workloads if ns(w) == ns(pool) and selects(sel, pod_labels(w))]
        if not pods:
            problems.append(f"{pid}: spec.selector.matchLabels {sel} selects no pods of namespace {ns(pool)}")
        groups = set()
        shim_ports = set()
        for w in pods:
            shims = [c for c in all_containers(pod_spec(w)) if is_balanceroute(c) and br_role(c) == "worker"]
            if not shims:
                problems.append(f"{pid}: spec.selector selects {obj_id(w)}, which runs no br-shim (only decode pods belong in the pool)")
                continue
            shim, env = shims[0], env_values(shims[0])
            groups.add(env.get("BALANCEROUTE_GROUP"))
            port = listen_port(env.get("BALANCEROUTE_LISTEN"))
            shim_ports.add(port)
            if set(targets) != {port}:
                problems.append(f"{pid}: spec.targetPorts {targets} must be the shim's listen port [{port}] "
                                f"(BALANCEROUTE_LISTEN of {obj_id(w)}/{shim['name']})")
            # br-decision answers Envoy with the endpoint the shim announced, and Envoy takes only
            # ip:port, one of the pool's podIP:targetPort endpoints.
            names = [e["name"] for e in shim.get("env", [])]
            m = re.fullmatch(r"http://\$\(([A-Za-z_][A-Za-z0-9_]*)\):(\d+)", env.get("BALANCEROUTE_ENDPOINT") or "")
            var = next((e for e in shim.get("env", []) if m and e["name"] == m.group(1)), None)
            if not m or int(m.group(2)) != port or var is None \
                    or (var.get("valueFrom") or {}).get("fieldRef", {}).get("fieldPath") != "status.podIP" \
                    or names.index(var["name"]) > names.index("BALANCEROUTE_ENDPOINT"):
                problems.append(f"{obj_id(w)}/{shim['name']}: BALANCEROUTE_ENDPOINT "
                                f"{env.get('BALANCEROUTE_ENDPOINT')!r} must be http://$(POD_IP):{port} with POD_IP "
                                "from status.podIP set before it: the picker's answer must be the pod's ip:port")

        ref = spec.get("endpointPickerRef") or {}
        if not ref:
            problems.append(f"{pid}: spec.endpointPickerRef missing: nothing would ask br-decision")
            continue
        kind, group = ref.get("kind", "Service"), ref.get("group", "")
        # CEL (endpointPickerRef): port is required when kind is Service (or unspecified).
        if kind == "Service" and "port" not in ref:
            problems.append(f"{pid}: spec.endpointPickerRef.port is required for kind Service")
            continue
        if (group, kind) != ("", "Service"):
            problems.append(f"{pid}: spec.endpointPickerRef must name a core Service, not {group or 'core'}/{kind}")
        if ref.get("failureMode", "FailClose") != "FailClose":
            problems.append(f"{pid}: spec.endpointPickerRef.failureMode must be FailClose (without the picker, "
                            f"requests would go to ranks the policy did not choose), got {ref.get('failureMode')}")
        svc = next((o for o in objs if o["kind"] == "Service" and o["metadata"]["name"] == ref.get("name")
                    and ns(o) == ns(pool)), None)
        if svc is None:
            problems.append(f"{pid}: spec.endpointPickerRef.name {ref.get('name')!r}: no Service of that name in {ns(pool)}")
            continue
        if svc["spec"].get("type") == "ExternalName":
            problems.append(f"{pid}: spec.endpointPickerRef names ExternalName Service {obj_id(svc)}, which "
                            "implementations must not follow")
            continue
        number = (ref.get("port") or {}).get("number")
        sport = next((p for p in svc["spec"].get("ports", []) if p.get("port") == number), None)
        if sport is None:
            problems.append(f"{pid}: spec.endpointPickerRef.port.number {number} is no port of {obj_id(svc)}")
            continue
        # Envoy speaks gRPC (HTTP/2) to the picker; gateways that take the protocol from the
        # Service (Istio: appProtocol or a name prefix; the port is named ext-proc) need it said.
        if sport.get("appProtocol") != "grpc":
            problems.append(f"{obj_id(svc)}: port {number} needs appProtocol grpc, got {sport.get('appProtocol')!r}")
        deciders = [w for w in workloads if selects(svc["spec"].get("selector", {}), pod_labels(w))]
        decision = {obj_id(w): next((c for c in all_containers(pod_spec(w)) if br_role(c) == "decision"), None)
                    for w in deciders}
        if not deciders or None in decision.values():
            problems.append(f"{obj_id(svc)}: must select the br-decision pods, selects {sorted(decision) or 'none'}")
            continue
        for w in deciders:
            c = decision[obj_id(w)]
            env = env_values(c)
            tp = sport.get("targetPort", sport.get("port"))
            cport = next((p["containerPort"] for p in c.get("ports", []) if tp in (p.get("name"), p["containerPort"])), None)
            want = listen_port(env.get("BALANCEROUTE_EXT_PROC_LISTEN"))
            if want is None or cport != want:
                problems.append(f"{obj_id(svc)}: port {number} reaches container port {cport} of {obj_id(w)}/{c['name']}, "
                                f"not its ext_proc port (BALANCEROUTE_EXT_PROC_LISTEN={env.get('BALANCEROUTE_EXT_PROC_LISTEN')})")
            if len(groups) == 1 and env.get("BALANCEROUTE_EXT_PROC_DEFAULT_GROUP") not in groups:
                problems.append(f"{obj_id(w)}/{c['name']}: BALANCEROUTE_EXT_PROC_DEFAULT_GROUP "
                                f"{env.get('BALANCEROUTE_EXT_PROC_DEFAULT_GROUP')!r} is not the pool's group {sorted(groups)[0]!r} "
                                "(requests without x-balanceroute-group would be refused or misplaced)")
            # The Envoy pods of the Gateways routing to this pool reach the picker and the shims
            # (labelled by the Gateway's infrastructure.labels).
            for g in gateways_of(pool, gateways, routes):
                labels = (g["spec"].get("infrastructure") or {}).get("labels") or {}
                for to, port in [([w], cport)] + [(pods, p) for p in sorted(shim_ports - {None})]:
                    if not admitted(objs, labels, to, port or 0):
                        problems.append(f"{obj_id(g)}: no NetworkPolicy admits its proxies (labels {labels}) to "
                                        f"port {port} of {', '.join(map(obj_id, to))}")

    for g in gateways:
        listeners = g["spec"].get("listeners", [])
        lnames = [l.get("name") for l in listeners]
        # CEL (listeners): names unique; no tls on an HTTP listener.
        if len(lnames) != len(set(lnames)):
            problems.append(f"{obj_id(g)}: spec.listeners names {lnames} must be unique")
        for l in listeners:
            if l.get("protocol") == "HTTP" and "tls" in l:
                problems.append(f"{obj_id(g)}: listener {l.get('name')}: tls must not be set for protocol HTTP")

    routed: set[tuple] = set()
    for r in routes:
        rid = obj_id(r)
        for pref in r["spec"].get("parentRefs", []):
            gns = pref.get("namespace", ns(r))
            is_gateway = (pref.get("group", GATEWAY_GROUP), pref.get("kind", "Gateway")) == (GATEWAY_GROUP, "Gateway")
            g = next((g for g in gateways if is_gateway and g["metadata"]["name"] == pref.get("name") and ns(g) == gns), None)
            if g is None:
                problems.append(f"{rid}: parentRef {pref.get('kind', 'Gateway')} {gns}/{pref.get('name')} names no rendered Gateway")
                continue
            listeners = [l for l in g["spec"].get("listeners", [])
                         if pref.get("sectionName") in (None, l.get("name"))]
            if not listeners:
                problems.append(f"{rid}: parentRef sectionName {pref.get('sectionName')!r} is no listener of {obj_id(g)}")
            for l in listeners:
                frm = ((l.get("allowedRoutes") or {}).get("namespaces") or {}).get("from", "Same")
                if l.get("protocol") not in ("HTTP", "HTTPS") or (frm == "Same" and gns != ns(r)):
                    problems.append(f"{rid}: listener {l.get('name')} of {obj_id(g)} does not take this HTTPRoute "
                                    f"(protocol {l.get('protocol')}, routes from {frm})")
        for i, rule in enumerate(r["spec"].get("rules", [])):
            for m in rule.get("matches", []):
                path = m.get("path") or {}
                # CEL (path): Exact and PathPrefix values are absolute paths without '//'.
                if path.get("type", "PathPrefix") in ("Exact", "PathPrefix") and \
                        (not str(path.get("value", "/")).startswith("/") or "//" in str(path.get("value", "/"))):
                    problems.append(f"{rid}: rules[{i}] path {path.get('value')!r} must be absolute, without '//'")
            for b in rule.get("backendRefs", []):
                if (b.get("group"), b.get("kind")) != (INFERENCE_GROUP, "InferencePool"):
                    continue
                bns = b.get("namespace", ns(r))
                pool = next((p for p in pools if p["metadata"]["name"] == b.get("name") and ns(p) == bns), None)
                if pool is None:
                    problems.append(f"{rid}: rules[{i}] backendRef names InferencePool {bns}/{b.get('name')}, which is not rendered")
                    continue
                routed.add((ns(pool), pool["metadata"]["name"]))
                ports = [t.get("number") for t in pool["spec"].get("targetPorts", [])]
                if "port" in b and b["port"] not in ports:
                    problems.append(f"{rid}: rules[{i}] backendRef port {b['port']} is not a targetPort {ports} of {obj_id(pool)}")
    for pool in pools:
        if (ns(pool), pool["metadata"]["name"]) not in routed:
            problems.append(f"{obj_id(pool)}: no HTTPRoute sends requests to it")
    assert not problems, "; ".join(dict.fromkeys(problems))
    return f"{len(pools)} InferencePool, {len(gateways)} Gateway, {len(routes)} HTTPRoute"


def check_pool_schemas(objs: list[dict]) -> None:
    """Minimal-schema validation of the InferencePool, Gateway and HTTPRoute objects (for the self-test)."""
    problems = []
    crd_objs = [o for o in objs if o.get("apiVersion", "").split("/")[0] in (INFERENCE_GROUP, GATEWAY_GROUP)]
    assert crd_objs, "no InferencePool, Gateway or HTTPRoute to validate"
    for o in crd_objs:
        try:
            schema_validate(o)
        except AssertionError as e:
            problems.append(str(e))
    assert not problems, "; ".join(problems)


def check_inference_pool_selftest(objs: list[dict]) -> str:
    """The minimal schemas and check_inference_pool catch what they are meant to catch:
    each mutation of the passing objects (overlays/inference-pool plus the vLLM example) must
    fail the check named beside it."""
    import copy

    def pool(os_):
        return find(os_, "InferencePool", "decode-g8")["spec"]

    def shim_env(os_):
        return pod_spec(find(os_, "StatefulSet", "vllm-decode"))["initContainers"][0]["env"]

    def decision_env(os_):
        return pod_spec(find(os_, "Deployment", "decision"))["containers"][0]["env"]

    # The minimal schemas: fields and values the API forbids.
    def no_selector(os_):
        del pool(os_)["selector"]

    def selector_expressions(os_):  # the pool's selector is matchLabels only
        pool(os_)["selector"]["matchExpressions"] = [{"key": "app.kubernetes.io/name", "operator": "Exists"}]

    def picker_namespace(os_):  # endpointPickerRef has no namespace: same namespace only
        pool(os_)["endpointPickerRef"]["namespace"] = "br-all"

    def fail_soft(os_):
        pool(os_)["endpointPickerRef"]["failureMode"] = "FailSoft"

    def route_unknown_field(os_):
        find(os_, "HTTPRoute", "decode-g8")["spec"]["rules"][0]["backendRefs"][0]["pool"] = "decode-g8"

    def gateway_no_listeners(os_):
        del find(os_, "Gateway", "inference-gateway")["spec"]["listeners"]

    def pool_no_name(os_):
        del find(os_, "InferencePool", "decode-g8")["metadata"]["name"]

    # The cross-checks, CEL rules included.
    def wrong_target_port(os_):
        pool(os_)["targetPorts"] = [{"number": 8000}]  # vLLM's own port, behind the shim

    def duplicate_target_port(os_):
        pool(os_)["targetPorts"] = [{"number": 8100}, {"number": 8100}]

    def selector_misses(os_):
        pool(os_)["selector"]["matchLabels"]["app.kubernetes.io/name"] = "vllm-prefill"

    def selector_takes_control_plane(os_):
        pool(os_)["selector"]["matchLabels"] = {"app.kubernetes.io/part-of": "balanceroute"}

    def shim_announces_dns(os_):
        next(e for e in shim_env(os_) if e["name"] == "BALANCEROUTE_ENDPOINT")["value"] = \
            "http://$(POD_NAME).vllm-decode.br-g8.svc:8100"

    def wrong_picker_port(os_):
        pool(os_)["endpointPickerRef"]["port"]["number"] = 50063  # decision's gRPC port

    def picker_without_port(os_):
        del pool(os_)["endpointPickerRef"]["port"]

    def missing_picker_service(os_):
        pool(os_)["endpointPickerRef"]["name"] = "balanceroute-epp"

    def external_name_picker(os_):
        svc = find(os_, "Service", "decision-ext-proc")
        svc["spec"] = {"type": "ExternalName", "externalName": "decision-ext-proc.balanceroute.svc.cluster.local",
                       "ports": svc["spec"]["ports"]}

    def no_picker(os_):  # the schema allows it; then nothing would ask br-decision
        del pool(os_)["endpointPickerRef"]

    def picker_other_kind(os_):
        pool(os_)["endpointPickerRef"] |= {"group": "gateway.envoyproxy.io", "kind": "Backend"}

    def picker_selects_ingest(os_):
        find(os_, "Service", "decision-ext-proc")["spec"]["selector"]["app.kubernetes.io/name"] = "br-ingest"

    def picker_plain_http(os_):
        find(os_, "Service", "decision-ext-proc")["spec"]["ports"][0].pop("appProtocol")

    def picker_targets_grpc_port(os_):
        find(os_, "Service", "decision-ext-proc")["spec"]["ports"][0]["targetPort"] = "grpc"

    def fail_open(os_):
        pool(os_)["endpointPickerRef"]["failureMode"] = "FailOpen"

    def no_default_group(os_):
        env = decision_env(os_)
        env[:] = [e for e in env if e["name"] != "BALANCEROUTE_EXT_PROC_DEFAULT_GROUP"]

    def route_to_missing_pool(os_):  # beside the real one, so the pool stays routed
        find(os_, "HTTPRoute", "decode-g8")["spec"]["rules"][0]["backendRefs"].append(
            {"group": INFERENCE_GROUP, "kind": "InferencePool", "name": "decode-g9"})

    def pool_unrouted(os_):
        del find(os_, "HTTPRoute", "decode-g8")["spec"]["rules"][0]["backendRefs"]

    def route_to_missing_gateway(os_):
        find(os_, "HTTPRoute", "decode-g8")["spec"]["parentRefs"][0]["name"] = "public-gateway"

    def route_port_mismatch(os_):
        find(os_, "HTTPRoute", "decode-g8")["spec"]["rules"][0]["backendRefs"][0]["port"] = 8000

    def listener_tcp(os_):
        find(os_, "Gateway", "inference-gateway")["spec"]["listeners"][0]["protocol"] = "TCP"

    def duplicate_listener(os_):
        listeners = find(os_, "Gateway", "inference-gateway")["spec"]["listeners"]
        listeners.append(listeners[0] | {"port": 8080})

    def route_to_missing_listener(os_):
        find(os_, "HTTPRoute", "decode-g8")["spec"]["parentRefs"][0]["sectionName"] = "https"

    def relative_path(os_):
        find(os_, "HTTPRoute", "decode-g8")["spec"]["rules"][0]["matches"][0]["path"]["value"] = "v1/"

    def gateway_unlabelled(os_):
        find(os_, "Gateway", "inference-gateway")["spec"]["infrastructure"]["labels"] = {"balanceroute.io/role": "edge"}

    def tls_on_http(os_):
        find(os_, "Gateway", "inference-gateway")["spec"]["listeners"][0]["tls"] = {"mode": "Terminate"}

    cases = [(f, check_pool_schemas) for f in (
        no_selector, selector_expressions, picker_namespace, fail_soft, route_unknown_field, gateway_no_listeners,
        pool_no_name)]
    cases += [(f, check_inference_pool) for f in (
        no_selector, wrong_target_port, duplicate_target_port, selector_misses, selector_takes_control_plane,
        shim_announces_dns, no_picker, picker_other_kind, wrong_picker_port, picker_without_port,
        missing_picker_service, external_name_picker, picker_selects_ingest, picker_plain_http,
        picker_targets_grpc_port, fail_open, no_default_group, route_to_missing_pool, pool_unrouted,
        route_port_mismatch, route_to_missing_gateway, route_to_missing_listener, listener_tcp, relative_path,
        gateway_unlabelled, duplicate_listener, tls_on_http)]
    for check in (check_pool_schemas, check_inference_pool):
        check(objs)  # the unmutated objects pass
    for mutate, check in cases:
        mutated = copy.deepcopy(objs)
        mutate(mutated)
        try:
            check(mutated)
        except AssertionError:
            continue
        raise AssertionError(f"{check.__name__} passed the mutation {mutate.__name__}")
    return f"{len(cases)} mutations caught"


def check_prometheusrule_in_sync(objs: list[dict], alerts: dict) -> str:
    rules = [o for o in objs if o["kind"] == "PrometheusRule"]
    assert rules, "no PrometheusRule rendered"
    for r in rules:
        assert r["spec"]["groups"] == alerts["groups"], \
            f"{obj_id(r)}: spec.groups differs from deploy/prometheus/alerts.yml (copy the groups over)"
    return f"{len(rules)} PrometheusRule"


def check_kinds(objs: list[dict], want: set[str], absent: set[str] = frozenset()) -> str:
    kinds = {o["kind"] for o in objs}
    assert want <= kinds, f"missing kinds {sorted(want - kinds)}"
    assert not (absent & kinds), f"unexpected kinds {sorted(absent & kinds)}"
    return ", ".join(sorted(kinds))


def check_toml(path: Path) -> None:
    with path.open("rb") as f:
        try:
            tomllib.load(f)
        except tomllib.TOMLDecodeError as e:
            raise AssertionError(str(e)) from None


# ---------------------------------------------------------------- metrics

def load_contract(path: Path) -> dict[str, str]:
    """name -> type ('' if none given)."""
    out: dict[str, str] = {}
    section = None
    problems = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        line = line.strip()
        if not line:
            continue
        if line.startswith("#"):
            word = line[1:].strip()
            if re.fullmatch(r"[a-z]+", word):
                section = word
            continue
        parts = line.split()
        name, typ = parts[0], (parts[1] if len(parts) > 1 else "")
        if len(parts) > 2 or typ not in ("", "counter", "gauge", "histogram", "summary"):
            problems.append(f"line {n}: bad entry {line!r}")
        if not re.fullmatch(r"balanceroute_[a-z]+_[a-z0-9_]+", name):
            problems.append(f"line {n}: {name} does not follow balanceroute_<service>_<what>_<unit>")
        elif section and name.split("_")[1] != section:
            problems.append(f"line {n}: {name} listed under '# {section}'")
        if typ == "counter" and not name.endswith("_total"):
            problems.append(f"line {n}: counter {name} must end in _total")
        if name in out:
            problems.append(f"line {n}: {name} listed twice")
        out[name] = typ
    assert not problems, "; ".join(problems)
    assert out, "no metrics in the contract"
    return out


PROMQL_WORDS = {
    # aggregation operators, modifiers and set/binary keywords (function names are skipped by
    # being followed by "(")
    "sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values", "bottomk",
    "topk", "quantile", "limitk", "limit_ratio", "by", "without", "on", "ignoring", "group_left",
    "group_right", "bool", "and", "or", "unless", "offset", "atan2", "inf", "nan",
}


def metric_names(expr: str) -> set[str]:
    """Metric names a PromQL (or Grafana templated PromQL) expression selects."""
    assert "__name__" not in expr, f"selects by __name__, which cannot be checked: {expr!r}"
    s = expr
    # Grafana's label_values(metric{...}, label) / label_values(label)
    lv = re.fullmatch(r"\s*label_values\(\s*(?:([A-Za-z_:][A-Za-z0-9_:]*)\s*(\{[^}]*\})?\s*,)?\s*[A-Za-z_][A-Za-z0-9_]*\s*\)\s*", s)
    if lv:
        return {lv.group(1)} if lv.group(1) else set()
    s = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`', '""', s)   # string literals
    s = re.sub(r"#[^\n]*", " ", s)                                            # comments
    s = re.sub(r"\$\{[^}]*\}|\$[A-Za-z_][A-Za-z0-9_]*", " 1 ", s)              # Grafana variables
    s = re.sub(r"\{[^}]*\}", " ", s)                                          # label matchers
    s = re.sub(r"\[[^\]]*\]", " ", s)                                         # ranges, subqueries
    s = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", s)
    names = set()
    for m in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", s):
        tok = m.group(0)
        before = s[m.start() - 1] if m.start() else " "
        if before.isdigit() or before == ".":
            continue  # the exponent or unit of a number or duration (1e-9, 5m)
        if s[m.end():].lstrip().startswith("("):
            continue  # a function or an aggregation
        if tok.lower() in PROMQL_WORDS:
            continue
        names.add(tok)
    return names


def resolve(name: str, contract: dict[str, str]) -> str | None:
    """The contract entry a queried series name belongs to, or None."""
    if name in contract:
        return name
    for suffix in ("_bucket", "_sum", "_count"):
        base = name[: -len(suffix)]
        if name.endswith(suffix) and contract.get(base) in ("histogram", "summary") \
                and (suffix != "_bucket" or contract[base] == "histogram"):
            return base
    return None


def dashboard_exprs(dash: dict) -> list[tuple[str, str]]:
    out = []

    def walk(panels):
        for p in panels:
            for t in p.get("targets", []):
                if t.get("expr"):
                    out.append((f"panel {p.get('id')} {p.get('title')!r} {t.get('refId')}", t["expr"]))
            walk(p.get("panels", []))
    walk(dash.get("panels", []))
    for v in dash.get("templating", {}).get("list", []):
        q = v.get("query")
        if isinstance(q, dict):
            q = q.get("query")
        if v.get("type") == "query" and q:
            out.append((f"variable ${v['name']}", q))
    return out


def alert_exprs(rules_doc: dict) -> list[tuple[str, str]]:
    out = []
    for g in rules_doc.get("groups", []):
        for r in g.get("rules", []):
            out.append((f"rule {r.get('alert') or r.get('record')}", str(r["expr"])))
    return out


def check_subset(exprs: list[tuple[str, str]], contract: dict[str, str], used: set[str] | None = None) -> str:
    assert exprs, "no queries found"
    unknown = []
    local: set[str] = set()
    for where, e in exprs:
        for n in sorted(metric_names(e)):
            base = resolve(n, contract)
            if base is None:
                unknown.append(f"{n} ({where})")
            else:
                local.add(base)
    assert not unknown, "not in deploy/metrics-contract.txt: " + ", ".join(unknown)
    if used is not None:
        used |= local
    return f"{len(exprs)} queries, {len(local)} contract metrics used"


def check_extractor_selftest(contract: dict[str, str]) -> None:
    """The subset check must catch what it is meant to catch (it is not vacuous)."""
    hist = next(n for n, t in contract.items() if t == "histogram")
    counter = next(n for n, t in contract.items() if t == "counter")
    cases = {
        f'histogram_quantile(0.99, sum by (le, group) (rate({hist}_bucket{{namespace=~"$namespace"}}[$__rate_interval])))': {f"{hist}_bucket"},
        f'sum(rate({counter}[5m])) / ignoring(reason) group_left clamp_min(sum(rate(balanceroute_bogus_total{{code="OK"}}[1m] offset 5m)), 1e-9) > 0.5': {counter, "balanceroute_bogus_total"},
        'label_values(balanceroute_x_y{namespace=~"$namespace"}, group)': {"balanceroute_x_y"},
        'sum by (pod) (max_over_time(foo:bar_ratio[5m:1m])) and on (pod) up == bool 1': {"foo:bar_ratio", "up"},
    }
    for expr, want in cases.items():
        got = metric_names(expr)
        assert got == want, f"extracted {sorted(got)} from {expr!r}, want {sorted(want)}"
    assert resolve(f"{hist}_bucket", contract) == hist
    assert resolve(f"{counter}_bucket", contract) is None
    try:
        check_subset([("self-test", "rate(balanceroute_bogus_total[5m])")], contract)
    except AssertionError:
        return
    raise AssertionError("an unknown metric passed the subset check")


def check_dashboard_structure(dash: dict) -> str:
    problems = []
    ids = []
    cells: dict[tuple[int, int], int] = {}
    for p in dash.get("panels", []):
        ids.append(p.get("id"))
        g = p.get("gridPos", {})
        if not all(isinstance(g.get(k), int) for k in "xywh") or g["x"] + g["w"] > 24:
            problems.append(f"panel {p.get('id')}: bad gridPos {g}")
            continue
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                if (x, y) in cells:
                    problems.append(f"panel {p.get('id')} overlaps panel {cells[(x, y)]}")
                    break
                cells[(x, y)] = p.get("id")
        if p.get("type") != "row":
            if not p.get("targets"):
                problems.append(f"panel {p.get('id')} {p.get('title')!r} has no queries")
            if p.get("datasource", {}).get("uid") != "${datasource}":
                problems.append(f"panel {p.get('id')} does not use the $datasource variable")
    if len(ids) != len(set(ids)):
        problems.append("duplicate panel ids")
    if not dash.get("uid") or not dash.get("title"):
        problems.append("dashboard needs uid and title")
    var_names = {v["name"] for v in dash.get("templating", {}).get("list", [])}
    for where, e in dashboard_exprs(dash):
        for v in re.findall(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)", e):
            if not v.startswith("__") and v not in var_names:
                problems.append(f"{where}: undefined variable ${v}")
    assert not problems, "; ".join(sorted(set(problems)))
    return f"{len(ids)} panels"


def promql_for_promtool(expr: str) -> str:
    e = re.sub(r"\$__(rate_interval|interval|range)\b", "5m", expr)
    return re.sub(r"\$\{[^}]*\}|\$[A-Za-z_][A-Za-z0-9_]*", ".*", e)


def check_promql_syntax(exprs: list[tuple[str, str]]) -> str:
    """Every dashboard query parses as PromQL: promtool checks them as recording rules."""
    rules = [{"record": f"dashboard:query_{i}", "expr": promql_for_promtool(e)}
             for i, (_, e) in enumerate(exprs) if not e.strip().startswith("label_values(")]
    with tempfile.NamedTemporaryFile("w", suffix=".yml", delete=False) as f:
        yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}, f)
    try:
        run([os.environ["BR_PROMTOOL"], "check", "rules", f.name])
    finally:
        os.unlink(f.name)
    return f"{len(rules)} queries"


def check_prom_config(promtool: str) -> str:
    """promtool check config, in full (rule files, TLS files): the scrape config names the admin
    client certificate where a Prometheus pod mounts it, which promtool stats; a copy with those
    paths pointing at empty stand-in files (and rule_files at deploy/prometheus) is checked."""
    text = PROM_CONFIG.read_text()
    files = sorted(set(re.findall(r"^\s*(?:ca_file|cert_file|key_file):\s*(\S+)\s*$", text, re.M)))
    with tempfile.TemporaryDirectory() as tmp:
        for i, f in enumerate(files):
            stand_in = Path(tmp, f"tls-{i}-{Path(f).name}")
            stand_in.touch()
            text = re.sub(rf"(:\s*){re.escape(f)}\s*$", rf"\g<1>{stand_in}", text, flags=re.M)
        conf = yaml.safe_load(text)
        conf["rule_files"] = [str(PROM_CONFIG.parent / r) for r in conf.get("rule_files", [])]
        copy = Path(tmp, "prometheus.yml")
        copy.write_text(yaml.safe_dump(conf, sort_keys=False))
        run([promtool, "check", "config", str(copy)])
    return f"{len(files)} TLS files stood in" if files else ""


def run(cmd: list[str], cwd: Path | None = None) -> str:
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=cwd)
    text = (out.stdout + out.stderr).strip()
    assert out.returncode == 0, f"{' '.join(cmd[1:])}: {text}"
    return ""


# ---------------------------------------------------------------- main

def main() -> int:
    c = Checks()

    # Kubernetes: render, schema-validate every object, cross-check objects.
    rendered: dict[str, list[dict]] = {}
    for name, (path, kinds) in RENDERS.items():
        objs = c.run(f"k8s render {name}", render, path)
        if objs is None:
            continue
        rendered[name] = objs
    for name, (resources, components, kinds) in COMPOSED.items():
        objs = c.run(f"k8s render {name}", render_composed, resources, components)
        if objs is not None:
            rendered[name] = objs
    for name, objs in rendered.items():
        kinds = RENDERS[name][1] if name in RENDERS else COMPOSED[name][2]
        c.run(f"k8s {name}: expected kinds", check_kinds, objs, kinds, COMPOSED_ABSENT.get(name, set()))
        for o in objs:
            c.run(f"k8s {name}: schema {obj_id(o)}", schema_validate, o)
        c.run(f"k8s {name}: consistency", check_consistency, objs, True)
        c.run(f"k8s {name}: trust (mTLS certificates, schemes)", check_trust, objs, True)
        c.run(f"k8s {name}: network policies", check_network_policies, objs, True)
        # The layout is read off the rendered objects: one decision replica
        # (decision-single-replica), otherwise two or more active-active ones. The all-in-one
        # (br-all) has no decision workload of its own: its one Service is checked for
        # consistency above, like every other.
        if any(o["kind"] == "Deployment" and o["metadata"]["name"] == "decision" for o in objs):
            c.run(f"k8s {name}: decision routing", check_decision_routing, objs, decision_is_single(objs))
    for ex in EXAMPLES:
        rel = ex.relative_to(DEPLOY)
        objs = c.run(f"k8s parse {rel}", load_yaml_docs, ex)
        if objs is None:
            continue
        for o in objs:
            c.run(f"k8s {rel}: schema {obj_id(o)}", schema_validate, o)
        c.run(f"k8s {rel}: consistency", check_consistency, objs, False)
        c.run(f"k8s {rel}: trust (mTLS certificates, schemes)", check_trust, objs, False)
        c.run(f"k8s {rel}: network policies", check_network_policies, objs, False)
    vllm = next((ex for ex in EXAMPLES if ex.name == "vllm-decode-with-shim.yaml"), None)
    if "overlays/group-g8-monitoring" in rendered and vllm is not None:
        # The example's Issuer is the control plane's: check it together with that render.
        c.run("k8s trust and network-policy checks self-test", check_trust_selftest,
              rendered["overlays/group-g8-monitoring"], rendered["overlays/group-g8-monitoring"] + load_yaml_docs(vllm))
    if "overlays/inference-pool" in rendered and vllm is not None:
        # The pool's members are the example's decode pods, in the control plane's namespace.
        pool_objs = rendered["overlays/inference-pool"] + load_yaml_docs(vllm)
        c.run("k8s overlays/inference-pool + vLLM example: InferencePool, Gateway, HTTPRoute",
              check_inference_pool, pool_objs)
        c.run("k8s InferencePool schema and cross-checks self-test", check_inference_pool_selftest, pool_objs)
    for toml_file in sorted(K8S.rglob("*.toml")):
        c.run(f"config parses as TOML: {toml_file.relative_to(DEPLOY)}", check_toml, toml_file)

    # Metrics: the contract, and dashboard/alerts only query what it lists.
    contract = c.run("metrics contract well-formed", load_contract, CONTRACT)
    dash = c.run("grafana dashboard parses", lambda: json.loads(DASHBOARD.read_text()))
    rules = c.run("alert rules parse", lambda: yaml.safe_load(ALERTS.read_text()))
    rule_tests = c.run("alert rule tests parse", lambda: yaml.safe_load(ALERT_TESTS.read_text()))
    if dash is not None:
        c.run("grafana dashboard structure", check_dashboard_structure, dash)
        c.run("grafana queries are valid PromQL (promtool)", check_promql_syntax, dashboard_exprs(dash))
    if contract is not None:
        c.run("metric extractor self-test", check_extractor_selftest, contract)
        shown: set[str] = set()
        if dash is not None:
            c.run("grafana queries ⊆ metrics contract", check_subset, dashboard_exprs(dash), contract, shown)
        if rules is not None:
            c.run("alert rules ⊆ metrics contract", check_subset, alert_exprs(rules), contract, shown)
        unshown = sorted(set(contract) - shown)
        if unshown:  # information only: the contract may hold metrics meant for other tools
            print(f"info contract metrics on no dashboard panel or alert: {', '.join(unshown)}")
        if rules is not None and "overlays/group-g8-monitoring" in rendered:
            c.run("PrometheusRule matches alerts.yml", check_prometheusrule_in_sync,
                  rendered["overlays/group-g8-monitoring"], rules)
        if rule_tests is not None:
            series = [("alerts_test input", t["series"]) for tc in rule_tests.get("tests", [])
                      for t in tc.get("input_series", [])]
            c.run("alert test series ⊆ metrics contract", check_subset, series, contract)

    # Prometheus config and rules, with promtool.
    promtool = os.environ["BR_PROMTOOL"]
    c.run("promtool check rules alerts.yml", run, [promtool, "check", "rules", str(ALERTS)])
    c.run("promtool check config prometheus.yml", check_prom_config, promtool)
    c.run("promtool test rules alerts_test.yml", run, [promtool, "test", "rules", ALERT_TESTS.name], ALERTS.parent)

    # Dockerfile lint.
    c.run("hadolint Dockerfile", run, [os.environ["BR_HADOLINT"], "--failure-threshold", "info", str(DOCKERFILE)])

    print(f"deploy: {c.passed} passed, {c.failed} failed", flush=True)
    return 1 if c.failed else 0


if __name__ == "__main__":
    sys.exit(main())
