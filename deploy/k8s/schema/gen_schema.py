#!/usr/bin/python3
"""Writes the strict JSON schema of the Kubernetes kinds our manifests use, from the models that
@kubernetes/client-node generates from Kubernetes' OpenAPI spec (deploy/k8s/schema/README.md).

    npm pack @kubernetes/client-node@1.1.2 && tar xzf kubernetes-client-node-1.1.2.tgz
    /usr/bin/python3 deploy/k8s/schema/gen_schema.py package \
        > deploy/k8s/schema/kubernetes-1.32.json

Each model `dist/gen/models/NAME.js` lists its fields (`attributeTypeMap`: JSON name, type,
format) and `NAME.d.ts` marks the optional ones (`'field'?:`). Every object gets
`additionalProperties: false`, as kubectl's strict field validation rejects unknown fields; maps
(`{ [key: string]: T; }`) stay open. Only the definitions reachable from KINDS are written.
"""

import json
import os
import re
import sys

# (apiVersion, kind) -> the client's model. All are v1, whose models are named V1<Kind>.
KINDS = [
    ("apps/v1", "StatefulSet"),
    ("batch/v1", "Job"),
    ("networking.k8s.io/v1", "NetworkPolicy"),
    ("policy/v1", "PodDisruptionBudget"),
    ("v1", "ConfigMap"),
    ("v1", "Namespace"),
    ("v1", "PersistentVolumeClaim"),
    ("v1", "Secret"),
    ("v1", "Service"),
]

# resource.Quantity fields, which the generated client types as strings. The API takes a number
# there too (`nvidia.com/gpu: 8`), and checks the text against this pattern (its regexp in
# k8s.io/apimachinery/pkg/api/resource: "8Gi" passes, "8GiB" does not).
QUANTITY = {"type": ["string", "number"],
            "pattern": r"^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$"}
QUANTITY_FIELDS = {
    "V1ResourceRequirements": {"limits", "requests"},
    "V1VolumeResourceRequirements": {"limits", "requests"},
    "V1PodSpec": {"overhead"},
    "V1EmptyDirVolumeSource": {"sizeLimit"},
    "V1PersistentVolumeClaimStatus": {"capacity", "allocatedResources"},
    "V1ContainerStatus": {"allocatedResources"},
}

ATTRIBUTES = re.compile(r"\.attributeTypeMap = (\[.*?\]);", re.S)
FIELD = re.compile(r"^    '([^']+)'(\??):", re.M)
MAP = re.compile(r"^\{ \[key: string\]: (.+); \}$")
ARRAY = re.compile(r"^Array<(.+)>$")


def read_model(models, name):
    """[(json name, type, format)], {required json names} of one model."""
    with open(os.path.join(models, name + ".js")) as f:
        match = ATTRIBUTES.search(f.read())
    if match is None:
        sys.exit(f"gen_schema: {name}.js has no attributeTypeMap")
    attributes = json.loads(match.group(1))
    with open(os.path.join(models, name + ".d.ts")) as f:
        declared = FIELD.findall(f.read())
    required = {field for field, optional in declared if not optional}
    # The .d.ts names fields as the class does; the JSON name (baseName) is what manifests use.
    by_name = {a["name"]: a["baseName"] for a in attributes}
    return ([(a["baseName"], a["type"], a["format"]) for a in attributes],
            {by_name[field] for field in required if field in by_name})


def type_schema(kind, fmt, pending):
    if kind == "string" or kind == "Date":
        return {"type": "string"}
    if kind == "number":
        return {"type": "integer"} if fmt in ("int32", "int64") else {"type": "number"}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "any":
        return {}
    if kind == "IntOrString":
        return {"type": ["integer", "string"]}
    match = ARRAY.match(kind)
    if match:
        return {"type": "array", "items": type_schema(match.group(1), "", pending)}
    match = MAP.match(kind)
    if match:
        return {"type": "object", "additionalProperties": type_schema(match.group(1), "", pending)}
    if not re.match(r"^[A-Z][A-Za-z0-9]*$", kind):
        sys.exit(f"gen_schema: unknown type {kind!r}")
    pending.append(kind)
    return {"$ref": "#/definitions/" + kind}


def main():
    if len(sys.argv) != 2:
        sys.exit("usage: gen_schema.py PACKAGE_DIR  (an unpacked @kubernetes/client-node)")
    package = sys.argv[1]
    models = os.path.join(package, "dist", "gen", "models")
    with open(os.path.join(package, "package.json")) as f:
        version = json.load(f)["version"]
    with open(os.path.join(models, "V1Pod.js")) as f:
        spec = re.search(r"OpenAPI spec version: (\S+)", f.read()).group(1)

    definitions = {}
    quantities = set()
    pending = ["V1" + kind for _, kind in KINDS]
    while pending:
        name = pending.pop()
        if name in definitions:
            continue
        fields, required = read_model(models, name)
        properties = {}
        for field, kind, fmt in fields:
            if field in QUANTITY_FIELDS.get(name, ()):
                quantities.add((name, field))
                quantity = {"$ref": "#/definitions/Quantity"}
                properties[field] = (quantity if kind == "string" else
                                     {"type": "object", "additionalProperties": quantity})
            else:
                properties[field] = type_schema(kind, fmt, pending)
        definition = {"type": "object", "properties": properties, "additionalProperties": False}
        if required:
            definition["required"] = sorted(required)
        definitions[name] = definition
    definitions["Quantity"] = QUANTITY
    missed = {(name, field) for name, fields in QUANTITY_FIELDS.items() if name in definitions
              for field in fields} - quantities
    if missed:
        sys.exit(f"gen_schema: QUANTITY_FIELDS names fields the models lack: {sorted(missed)}")

    lines = [
        "{",
        '"$comment": ' + json.dumps(
            "Generated by deploy/k8s/schema/gen_schema.py; do not edit (README.md beside it)."),
        ',"source": ' + json.dumps({"package": "@kubernetes/client-node", "version": version,
                                    "kubernetes": spec}),
        ',"kinds": ' + json.dumps({f"{api} {kind}": "V1" + kind for api, kind in KINDS}),
        ',"definitions": {',
    ]
    for i, name in enumerate(sorted(definitions)):
        lines.append(("," if i else "") + json.dumps(name) + ": " +
                     json.dumps(definitions[name], sort_keys=True))
    lines += ["}", "}"]
    sys.stdout.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
