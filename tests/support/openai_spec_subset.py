"""Cut OpenAI's official OpenAPI document down to the operations servelm implements, for a fuzz run.

    git clone https://github.com/openai/openai-openapi   # or any copy of its openapi.yaml
    python tests/support/openai_spec_subset.py openai-openapi/openapi.yaml http://127.0.0.1:8000/v1 \
        --model tiny --embedding-model all-MiniLM-L6-v2 -o openai_servelm.yaml
    st run openai_servelm.yaml -c not_a_server_error -n 400 -w 1 --request-timeout 120 \
        --generation-deterministic

`model` is pinned to the served names; otherwise nearly every generated request stops at a 404 and
the fuzz never reaches generation. Everything else stays as OpenAI documents it.
"""

from __future__ import annotations

import argparse

import yaml

OPERATIONS = {"createChatCompletion", "createCompletion", "createEmbedding", "listModels", "retrieveModel"}


def _with_model(schema: dict, schemas: dict) -> dict | None:
    """The (sub)schema that declares the `model` property, following $ref and allOf/anyOf/oneOf."""
    if "$ref" in schema:
        return _with_model(schemas[schema["$ref"].rsplit("/", 1)[-1]], schemas)
    if "model" in schema.get("properties", {}):
        return schema
    for key in ("allOf", "anyOf", "oneOf"):
        for part in schema.get(key, []):
            if (found := _with_model(part, schemas)) is not None:
                return found
    return None


def subset(spec: dict, base_url: str, model: str, embedding_model: str) -> dict:
    paths = {}
    for path, ops in spec["paths"].items():
        kept = {m: op for m, op in ops.items() if isinstance(op, dict) and op.get("operationId") in OPERATIONS}
        if kept:
            paths[path] = {**kept, **({"parameters": ops["parameters"]} if "parameters" in ops else {})}
    schemas = spec["components"]["schemas"]
    for name, served in (("CreateChatCompletionRequest", model), ("CreateCompletionRequest", model),
                         ("CreateEmbeddingRequest", embedding_model)):
        found = _with_model(schemas[name], schemas)
        if found is None:
            raise SystemExit(f"{name} has no `model` property: the spec changed shape")
        found["properties"]["model"] = {"type": "string", "enum": [served]}
    return {**spec, "paths": paths, "servers": [{"url": base_url}]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("spec", help="OpenAI's openapi.yaml")
    p.add_argument("base_url", help="e.g. http://127.0.0.1:8000/v1")
    p.add_argument("--model", required=True, help="the served generation model's name")
    p.add_argument("--embedding-model", default="all-MiniLM-L6-v2")
    p.add_argument("-o", "--output", default="openai_servelm.yaml")
    args = p.parse_args()
    with open(args.spec) as f:
        spec = yaml.safe_load(f)
    with open(args.output, "w") as f:
        yaml.safe_dump(subset(spec, args.base_url, args.model, args.embedding_model), f, sort_keys=False)
    print(f"wrote {args.output}: {sorted(OPERATIONS)}")


if __name__ == "__main__":
    main()
