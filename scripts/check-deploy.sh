#!/usr/bin/env bash
# Offline checks of deploy/ (no cluster, no registry): yamllint on every YAML file, the
# Kubernetes manifests against the API schemas kubernetes-validate ships (strict: unknown fields
# fail; the CRD kinds it has no schema for, ServiceMonitor, InferencePool, ScaledObject and the
# Kustomization, are checked for their required fields here instead), every file a
# kustomization lists exists, `promtool check rules` on the alert rules, and the Grafana
# dashboard parses as JSON. The e2e test `deploy::deploy_files_pass_offline_checks` runs it.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="$(scripts/python-env.sh)"
PROMTOOL="$(scripts/ensure-promtool.sh)"

"$PY" -m yamllint --strict -c deploy/.yamllint deploy
mapfile -t manifests < <(find deploy/kubernetes -name '*.yaml' ! -name kustomization.yaml | sort)
out="$("$PY" -m kubernetes_validate --strict "${manifests[@]}" 2>&1)" || { echo "$out"; exit 1; }
"$PY" - "${manifests[@]}" <<'PY'
import os, sys, yaml
# Required fields of the CRD kinds the schemas do not cover.
required = {
    "ServiceMonitor": [["spec", "selector"], ["spec", "endpoints"]],
    "InferencePool": [["spec", "selector", "matchLabels"], ["spec", "targetPorts"], ["spec", "endpointPickerRef", "name"]],
    "ScaledObject": [["spec", "scaleTargetRef", "name"], ["spec", "triggers"]],
}
kinds = set()
for path in sys.argv[1:]:
    for doc in yaml.safe_load_all(open(path)):
        kinds.add(doc["kind"])
        for keys in required.get(doc["kind"], []):
            node = doc
            for k in keys:
                assert isinstance(node, dict) and k in node, f"{path}: {doc['kind']} lacks {'.'.join(keys)}"
                node = node[k]
for want in ["Deployment", "Service", "PodDisruptionBudget", "HorizontalPodAutoscaler", "ServiceMonitor", "InferencePool"]:
    assert want in kinds, f"no {want} in deploy/kubernetes"
for root, _, files in os.walk("deploy/kubernetes"):
    if "kustomization.yaml" in files:
        k = yaml.safe_load(open(os.path.join(root, "kustomization.yaml")))
        for r in k.get("resources", []):
            assert os.path.exists(os.path.join(root, r)), f"{root}/kustomization.yaml lists missing {r}"
PY
"$PROMTOOL" check rules deploy/prometheus/*.yaml
"$PY" -m json.tool deploy/grafana/tessera-dashboard.json >/dev/null
echo "deploy/ checks passed"
