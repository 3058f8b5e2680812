"""openapi_ops.py - docs/openapi.yaml as the tests walk it: every operation, who may call it, the
objects its parameters and body name, and a minimal valid request for it.

The document marks each operation with `x-kiln-access` (public, tenant or admin) and each id
schema with `x-kiln-object` (tenant, api_key, sandbox, snapshot); tests/unit/openapi/check_openapi.py
requires both, so a new route or path parameter always says what it is. Needs python3-yaml.
"""
import os
import re
from urllib.parse import urlencode

import yaml

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
METHODS = ("get", "put", "post", "delete", "patch", "head", "options", "trace")
JSON = "application/json"


class Operation:
    """One METHOD /path of the document.

    access   "public", "tenant" or "admin" (None when the document does not say)
    path_objects  {path parameter: object kind}; a kind is None when its schema names none
    refs     [(where, name, kind)]: query parameters ("query") and top-level body properties
             ("body") whose schema names an object kind
    query    {name: value} for the required query parameters (their example)
    body     a minimal valid request body: a dict for JSON, bytes for a raw upload (the media
             type's example when it has one), or None
    """

    def __init__(self, api, method, path, op, item):
        self.method = method.upper()
        self.path = path
        self.op = op
        self.operation_id = op.get("operationId")
        self.access = op.get("x-kiln-access")
        self.scope = op.get("x-kiln-scope")
        params = [api.resolve(p) or {} for p in item.get("parameters", []) + op.get("parameters", [])]
        self.path_objects = {}
        self.refs = []
        self.query = {}
        for p in params:
            kind = api.object_kind(p.get("schema"))
            if p.get("in") == "path":
                self.path_objects[p["name"]] = kind
            elif p.get("in") == "query":
                if kind:
                    self.refs.append(("query", p["name"], kind))
                elif p.get("required"):
                    self.query[p["name"]] = api.example(p.get("schema"), p)
        self.body = None
        self.content_type = None
        body = api.resolve(op.get("requestBody")) or {}
        content = body.get("content") or {}
        if JSON in content:
            self.content_type = JSON
            schema = content[JSON].get("schema")
            self.body = api.minimal(schema)
            props, _ = api.fields(schema)
            for name, p in props.items():
                kind = api.object_kind(p)
                if kind:
                    self.refs.append(("body", name, kind))
        elif content:
            self.content_type = next(iter(content))
            example = content[self.content_type].get("example")
            self.body = example.encode() if isinstance(example, str) else b"kiln tenant matrix\n"

    def __repr__(self):
        return "%s %s" % (self.method, self.path)

    def url(self, ids, extra_query=None):
        """The path with each {param} replaced by ids[param], and the query parameters."""
        path = re.sub(r"\{([^}]+)\}", lambda m: ids[m.group(1)], self.path)
        q = dict(self.query)
        q.update(extra_query or {})
        if q:
            path += "?" + urlencode(q)
        return path


class Api:
    """docs/openapi.yaml (or `path`), parsed."""

    def __init__(self, path=None):
        with open(path or os.path.join(ROOT, "docs", "openapi.yaml"), encoding="utf-8") as f:
            self.doc = yaml.safe_load(f)

    def resolve(self, obj):
        seen = set()
        while isinstance(obj, dict) and "$ref" in obj:
            ref = obj["$ref"]
            if ref in seen or not ref.startswith("#/"):
                raise ValueError("bad $ref %r" % ref)
            seen.add(ref)
            node = self.doc
            for part in ref[2:].split("/"):
                node = node[part.replace("~1", "/").replace("~0", "~")]
            obj = node
        return obj

    def flatten(self, schema):
        """The schema with $ref and allOf merged into one dict."""
        schema = self.resolve(schema)
        if not isinstance(schema, dict):
            return {}
        out, props, required = {}, {}, set()
        for sub in schema.get("allOf", []):
            f = self.flatten(sub)
            props.update(f.get("properties", {}))
            required |= set(f.get("required", []))
            out.update({k: v for k, v in f.items() if k not in ("properties", "required")})
        out.update({k: v for k, v in schema.items() if k not in ("allOf", "properties", "required")})
        props.update(schema.get("properties", {}))
        required |= set(schema.get("required", []))
        if props:
            out["properties"] = props
        if required:
            out["required"] = sorted(required)
        return out

    def fields(self, schema):
        """(properties, required) of an object schema, a oneOf's branches united."""
        f = self.flatten(schema)
        props, req = dict(f.get("properties", {})), set(f.get("required", []))
        for br in f.get("oneOf", []):
            p, _ = self.fields(br)
            props.update(p)
        return props, req

    def object_kind(self, schema):
        """The x-kiln-object of a schema (through $ref and allOf), or None."""
        return self.flatten(schema).get("x-kiln-object") if schema is not None else None

    def example(self, schema, holder=None):
        """A valid value of a scalar or array schema: its example, default or enum, else the least
        value its bounds allow."""
        f = self.flatten(schema)
        for src in (holder or {}, f):
            if "example" in src:
                return src["example"]
        if "default" in f:
            return f["default"]
        if f.get("enum"):
            return f["enum"][0]
        t = f.get("type")
        if t == "integer" or t == "number":
            return f.get("minimum", 1)
        if t == "boolean":
            return False
        if t == "array":
            return [self.example(f.get("items"))] * max(1, f.get("minItems", 1))
        if t == "object":
            return self.minimal(f)
        if t == "string":
            if f.get("pattern", "").startswith("^/"):
                return "/"
            return "matrix"[: max(1, f.get("maxLength", 6))]
        raise ValueError("no value for schema %r" % (f,))

    def minimal(self, schema):
        """A minimal valid JSON body: the required properties of an object (of a oneOf, its first
        branch); when nothing is required, every scalar property, so the call does something.
        Properties that name an object (x-kiln-object) are left out: the caller fills them."""
        f = self.flatten(schema)
        if "oneOf" in f:
            return self.minimal(f["oneOf"][0])
        if f.get("type") not in (None, "object") or "properties" not in f:
            return {} if f.get("type") in (None, "object") else self.example(f)
        props, required = f["properties"], set(f.get("required", []))
        out = {}
        for name, p in props.items():
            pf = self.flatten(p)
            if pf.get("x-kiln-object"):
                continue
            if name in required:
                out[name] = self.example(p, p)
            elif not required and pf.get("type") in ("integer", "number", "boolean", "string"):
                out[name] = self.example(p, p)
        return out

    def operations(self):
        """Every operation of the document, in its order."""
        ops = []
        for path, item in (self.doc.get("paths") or {}).items():
            for method in METHODS:
                if method in item:
                    ops.append(Operation(self, method, path, item[method], item))
        return ops


def credentialed_operations():
    """(METHOD, path with its parameters filled) of every operation of docs/openapi.yaml that
    takes a credential (security other than [])."""
    return [(o.method, re.sub(r"\{[^}]+\}", "x_1", o.path)) for o in Api().operations()
            if o.op.get("security", None) != []]
