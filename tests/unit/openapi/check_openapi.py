#!/usr/bin/python3
"""
check_openapi.py - checks docs/openapi.yaml on its own and against the API contract (API.md).

    check_openapi.py OPENAPI_YAML API_MD              check the document; exit 0 when it passes
    check_openapi.py --self-test OPENAPI_YAML API_MD  check that the checks catch planted faults

The document must be well-formed (every $ref resolves, every operation has responses, an
X-Request-Id header on every response, security and x-kiln-scope where a credential is needed,
error responses whose codes belong to their status) and must agree with API.md: the same routes
(the tables' "METHOD /path" rows, the Operations paragraph and the credential-free routes named in
"Conventions"), the same scopes, error codes and statuses, and the request and response fields,
ranges, defaults and enums that API.md's rows spell out.

Exit status: 0 all checks pass; 1 a check failed (one line per problem); 2 a file is missing or
cannot be parsed. A missing API.md is a failure, never a skip: the cross-check is the point.
Needs only Python 3 and PyYAML (Debian: python3-yaml).
"""
import copy
import re
import sys

try:
    import yaml
except ImportError:
    sys.stderr.write("check_openapi: PyYAML is missing (Debian package python3-yaml)\n")
    sys.exit(2)

METHODS = ("get", "put", "post", "delete", "patch", "head", "options", "trace")
JSON = "application/json"
MIB = 1024 * 1024

# The Conventions bullet on scopes, as a rule: which scope each route needs. API_MD_SCOPE_PATHS
# lists the paths API.md names for each scope; the checker compares it with API.md's text, so a
# change of the contract's scopes fails here until this rule is updated too.
API_MD_SCOPE_PATHS = {
    "sandbox:read": {"/v1/sandboxes", "/v1/snapshots"},
    "sandbox:write": set(),  # "every other call under those paths"
    "billing:read": {"/v1/billing/balance", "/v1/usage", "/v1/audit"},  # "... and ledger"
    "keys:write": {"/v1/api-keys", "/v1/tokens", "/v1/storage"},
    "admin": {"/v1/tenants", "/v1/billing/grants"},
}


def expected_scope(method, path):
    """The scope API.md's Conventions give a route: (scope, scope needed to narrow) or None."""
    if path.startswith("/v1/sandboxes") or path.startswith("/v1/snapshots"):
        return ("sandbox:read" if method == "GET" else "sandbox:write"), None
    if path in ("/v1/billing/balance", "/v1/billing/ledger", "/v1/usage", "/v1/audit"):
        return "billing:read", None
    if path == "/v1/api-keys" or path.startswith("/v1/api-keys/") or path == "/v1/storage":
        return "keys:write", None
    if path == "/v1/tokens":
        # "keys:write (... /v1/tokens with narrower scopes ...)": a token with all of the key's
        # scopes needs no scope; asking for narrower ones needs keys:write.
        return "none", "keys:write"
    if path in ("/v1/tenants", "/v1/billing/grants"):
        return "admin", None
    return None


# Response fields the document has beyond the ones API.md's rows list, each with its reason.
# Anything else that differs is an error.
EXTRA_FIELDS = {
    ("POST /v1/api-keys", "expires_at"): "the key's expiry, set by the request, shown back",
    ("GET /v1/api-keys", "api_keys[].expires_at"): "a listing shows when each key expires",
    ("POST /v1/sandboxes/{id}/exec", "stdout_truncated"): "says when output past the cap was cut",
    ("POST /v1/sandboxes/{id}/exec", "stderr_truncated"): "says when output past the cap was cut",
    ("POST /v1/sandboxes/{id}/snapshots", "name"): "the name given in the request, shown back",
    ("POST /v1/sandboxes/{id}/snapshots", "reason"): "named in the row's prose (failed status)",
}


class StrictLoader(yaml.SafeLoader):
    """A safe loader that refuses duplicate mapping keys (PyYAML keeps the last silently)."""


def _mapping(loader, node, deep=False):
    keys = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in keys:
            raise yaml.constructor.ConstructorError(
                None, None, "duplicate key %r" % (key,), key_node.start_mark)
        keys.add(key)
    return loader.construct_mapping(node, deep)


StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping)


def load_yaml(text):
    return yaml.load(text, Loader=StrictLoader)


# ------------------------------------------------------------------------------------------------
# The OpenAPI document


class Doc:
    def __init__(self, doc):
        self.doc = doc
        self.errors = []

    def err(self, msg):
        self.errors.append(msg)

    def resolve(self, obj, seen=None):
        """Follows $ref chains; returns None (after reporting) when one does not resolve."""
        seen = seen or set()
        while isinstance(obj, dict) and "$ref" in obj:
            ref = obj["$ref"]
            if ref in seen:
                self.err("$ref cycle at %s" % ref)
                return None
            seen.add(ref)
            obj = self.pointer(ref)
            if obj is None:
                return None
        return obj

    def pointer(self, ref):
        if not isinstance(ref, str) or not ref.startswith("#/"):
            self.err("$ref %r is not a local JSON pointer" % (ref,))
            return None
        node = self.doc
        for part in ref[2:].split("/"):
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and part in node:
                node = node[part]
            else:
                self.err("$ref %s does not resolve" % ref)
                return None
        return node

    def flatten(self, schema):
        """A schema with $ref and allOf merged into one dict (properties and required united)."""
        schema = self.resolve(schema)
        if not isinstance(schema, dict):
            return {}
        out = {}
        props, required = {}, set()
        for sub in schema.get("allOf", []):
            f = self.flatten(sub)
            props.update(f.get("properties", {}))
            required |= set(f.get("required", []))
            for k, v in f.items():
                if k not in ("properties", "required"):
                    out[k] = v
        for k, v in schema.items():
            if k not in ("allOf", "properties", "required"):
                out[k] = v
        props.update(schema.get("properties", {}))
        required |= set(schema.get("required", []))
        if props:
            out["properties"] = props
        if required:
            out["required"] = sorted(required)
        return out

    def fields(self, schema):
        """(properties, required) of an object schema; a oneOf unites its branches' properties
        and keeps as required only what every branch requires."""
        f = self.flatten(schema)
        if "oneOf" in f:
            props, req = {}, None
            for br in f["oneOf"]:
                p, r = self.fields(br)
                props.update(p)
                req = set(r) if req is None else req & set(r)
            props.update(f.get("properties", {}))
            return props, (req or set()) | set(f.get("required", []))
        return f.get("properties", {}), set(f.get("required", []))

    def operations(self):
        for path, item in (self.doc.get("paths") or {}).items():
            if not isinstance(item, dict):
                continue
            for method in METHODS:
                if method in item:
                    yield path, method.upper(), item[method], item


def walk(node, where=""):
    """Yields (where, dict) for every mapping in the document."""
    if isinstance(node, dict):
        yield where, node
        for k, v in node.items():
            yield from walk(v, "%s/%s" % (where, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from walk(v, "%s/%d" % (where, i))


def error_codes_of(d, response):
    """The error codes an error response may carry, from its narrowed schema; None if it has none."""
    content = (response.get("content") or {}).get(JSON)
    if not content or "schema" not in content:
        return None
    schema = d.resolve(content["schema"])
    parts = schema.get("allOf", [schema]) if isinstance(schema, dict) else []
    codes, has_error = None, False
    for part in parts:
        if isinstance(part, dict) and part.get("$ref") == "#/components/schemas/Error":
            has_error = True
            continue
        code = (((d.resolve(part) or {}).get("properties") or {}).get("error") or {})
        code = ((code.get("properties") or {}).get("code")) or {}
        code = d.resolve(code) or {}
        if "enum" in code:
            codes = set(code["enum"])
    if not has_error:
        return None
    return codes


def check_structure(d, public_paths):
    doc = d.doc
    if doc.get("openapi") != "3.0.3":
        d.err("openapi must be 3.0.3, not %r" % (doc.get("openapi"),))
    for key in ("title", "version"):
        if not (doc.get("info") or {}).get(key):
            d.err("info.%s is missing" % key)
    comps = doc.get("components") or {}
    schemes = comps.get("securitySchemes") or {}

    # Every $ref resolves, has no siblings (OpenAPI 3.0 ignores them), and every component is used.
    used = set()
    for where, node in walk(doc):
        if "$ref" in node:
            if d.pointer(node["$ref"]) is not None:
                used.add(node["$ref"])
            extra = sorted(k for k in node if k != "$ref")
            if extra:
                d.err("%s: $ref has siblings %s, which OpenAPI 3.0 ignores" % (where, extra))
    for kind, items in comps.items():
        if kind == "securitySchemes":
            continue
        for name in items or {}:
            if "#/components/%s/%s" % (kind, name) not in used:
                d.err("components/%s/%s is never used" % (kind, name))

    # ErrorCode: an enum and its statuses.
    ec = (comps.get("schemas") or {}).get("ErrorCode") or {}
    status_of = ec.get("x-kiln-http-status") or {}
    if set(ec.get("enum", [])) != set(status_of):
        d.err("ErrorCode enum and x-kiln-http-status name different codes")
    err = d.flatten({"$ref": "#/components/schemas/Error"})
    inner = d.flatten(((err.get("properties") or {}).get("error")) or {})
    if set(inner.get("required", [])) != {"code", "message", "request_id"}:
        d.err("Error.error must require code, message and request_id")

    op_ids = {}
    for path, method, op, item in d.operations():
        name = "%s %s" % (method, path)
        oid = op.get("operationId")
        if not oid:
            d.err("%s: no operationId" % name)
        elif oid in op_ids:
            d.err("%s: operationId %s also used by %s" % (name, oid, op_ids[oid]))
        else:
            op_ids[oid] = name

        # Parameters: every {name} of the path is declared, and no others.
        params = [d.resolve(p) or {} for p in item.get("parameters", []) + op.get("parameters", [])]
        declared = {p.get("name") for p in params if p.get("in") == "path"}
        for p in params:
            if p.get("in") == "path" and not p.get("required"):
                d.err("%s: path parameter %s must be required" % (name, p.get("name")))
        wanted = set(re.findall(r"\{([^}]+)\}", path))
        if declared != wanted:
            d.err("%s: path parameters %s do not match the path's %s"
                  % (name, sorted(declared), sorted(wanted)))

        # Responses.
        responses = op.get("responses") or {}
        if not responses:
            d.err("%s: no responses" % name)
        if not any(str(s).startswith("2") for s in responses):
            d.err("%s: no 2xx response" % name)
        for status, resp in responses.items():
            status = str(status)
            r = d.resolve(resp) or {}
            if not re.fullmatch(r"[1-5][0-9][0-9]", status):
                d.err("%s: response %s is not an HTTP status" % (name, status))
                continue
            if not r.get("description"):
                d.err("%s %s: no description" % (name, status))
            if "X-Request-Id" not in (r.get("headers") or {}):
                d.err("%s %s: no X-Request-Id header" % (name, status))
            if int(status) >= 400:
                if path == "/healthz" and status == "503":
                    continue  # the health body says which check failed
                codes = error_codes_of(d, r)
                if codes is None:
                    d.err("%s %s: not an Error body narrowed to its codes" % (name, status))
                    continue
                for c in sorted(codes):
                    if str(status_of.get(c)) != status:
                        d.err("%s %s: code %s belongs to status %s"
                              % (name, status, c, status_of.get(c)))
            if status == "429" and "Retry-After" not in (r.get("headers") or {}):
                d.err("%s 429: no Retry-After header" % name)
            if status == "401" and "WWW-Authenticate" not in (r.get("headers") or {}):
                d.err("%s 401: no WWW-Authenticate header" % name)

        # Security and scopes.
        if "security" not in op:
            d.err("%s: no security (write [] for a public route)" % name)
            continue
        sec = op["security"]
        for req in sec:
            for scheme, scopes in req.items():
                if scheme not in schemes:
                    d.err("%s: unknown security scheme %s" % (name, scheme))
                elif scopes:
                    d.err("%s: scopes listed on bearer scheme %s (use x-kiln-scope)"
                          % (name, scheme))
        public = path in public_paths
        if public:
            if sec != []:
                d.err("%s: a public route must have security: []" % name)
            if "x-kiln-scope" in op:
                d.err("%s: a public route has x-kiln-scope" % name)
            for s in ("401", "403", "429"):
                if s in responses:
                    d.err("%s: a public route answers %s" % (name, s))
            continue
        if not sec:
            d.err("%s: needs a credential but has no security" % name)
        scope = op.get("x-kiln-scope")
        if not scope:
            d.err("%s: needs a credential but has no x-kiln-scope" % name)
        elif "`%s`" % scope not in (op.get("description") or "") and scope != "none":
            d.err("%s: the description does not name the scope `%s`" % (name, scope))
        for s in ("401", "403", "429", "500", "503"):
            if s not in responses:
                d.err("%s: needs a credential but has no %s response" % (name, s))

        # Mutating POSTs accept Idempotency-Key, with its 409 and 422.
        if method == "POST":
            keys = [p for p in params if p.get("in") == "header" and p.get("name") == "Idempotency-Key"]
            if not keys:
                d.err("%s: a mutating POST without the Idempotency-Key header" % name)
            for s in ("409", "422"):
                if s not in responses:
                    d.err("%s: accepts Idempotency-Key but has no %s response" % (name, s))

        # JSON request bodies are strict objects.
        body = d.resolve(op.get("requestBody")) or {}
        jschema = ((body.get("content") or {}).get(JSON) or {}).get("schema")
        if jschema is not None:
            f = d.flatten(jschema)
            branches = f.get("oneOf", [jschema])
            for br in branches:
                if d.flatten(br).get("additionalProperties") is not False:
                    d.err("%s: request body schema allows unknown fields" % name)
            if "413" not in responses or "400" not in responses:
                d.err("%s: takes a JSON body but lacks 400 or 413" % name)

    # Amount and time fields keep their types.
    for sname, schema in (comps.get("schemas") or {}).items():
        props, _ = d.fields({"$ref": "#/components/schemas/%s" % sname})
        for pname, p in props.items():
            f = d.flatten(p)
            if pname.endswith("_ucr") and f.get("type") != "integer":
                d.err("%s.%s: amounts are integers" % (sname, pname))
            if pname.endswith("_at") and (f.get("type"), f.get("format")) != ("string", "date-time"):
                d.err("%s.%s: times are date-time strings" % (sname, pname))


# ------------------------------------------------------------------------------------------------
# API.md


def md_rows(md):
    """Table rows as (first cell, second cell), with `\\|` unescaped."""
    rows = []
    for line in md.splitlines():
        if not line.startswith("|"):
            continue
        cells = [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", line)[1:-1]]
        if len(cells) < 2 or set(cells[0]) <= set("-: ") or cells[0] == "method, path":
            continue
        rows.append((cells[0], cells[1]))
    return rows


ROUTE_RE = re.compile(r"\b(GET|POST|PUT|DELETE|PATCH)\s+(/[^\s,()`]*)")


def md_section(md, title):
    m = re.search(r"^## %s\n(.*?)(?=^## |\Z)" % re.escape(title), md, re.S | re.M)
    return m.group(1) if m else ""


def md_bullet(section, start):
    """The text of the bullet of `section` that begins with `start`, joined into one line."""
    for b in re.split(r"\n- ", "\n" + section):
        if b.strip().startswith(start):
            return " ".join(b.split())
    return ""


class Spec:
    """A parsed `{a, b?:…, c:{…}}` field list of an API.md row."""

    def __init__(self, text):
        self.s = text
        self.i = 0

    def parse(self):
        return self.obj()

    def peek(self, n=1):
        return self.s[self.i:self.i + n]

    def ws(self):
        while self.i < len(self.s) and self.s[self.i] == " ":
            self.i += 1

    def obj(self):
        assert self.s[self.i] == "{"
        self.i += 1
        self.ws()
        if self.peek() == "…":
            self.i += 1
            self.ws()
            self.i += 1  # }
            return None  # any fields
        items = []
        alt = False
        while self.i < len(self.s):
            self.ws()
            if self.peek() == "}":
                self.i += 1
                break
            item = self.item()
            if item is None:
                break
            items.append(item)
            self.ws()
            if self.s.startswith("or ", self.i):
                self.i += 3
                item["alt"] = True
                alt = True
                continue
            if alt:
                item["alt"] = True
                alt = False
            if self.peek() == ",":
                self.i += 1
        return items

    def item(self):
        m = re.compile(r"[A-Za-z_][A-Za-z0-9_]*").match(self.s, self.i)
        if not m:
            return None
        it = {"name": m.group(0), "optional": False, "array": False, "children": None,
              "consts": [], "examples": None, "alt": False}
        self.i = m.end()
        if self.peek() == "?":
            it["optional"] = True
            self.i += 1
        if self.peek(2) == "[]":
            it["array"] = True
            self.i += 2
        if self.peek() != ":":
            return it
        self.i += 1
        c = self.peek()
        if c == "{":
            if self.peek(2) == "{}":
                self.i += 2
            else:
                it["children"] = self.obj()
        elif c == "[":
            it["array"] = True
            self.i += 1
            self.ws()
            if self.peek() == "{":
                it["children"] = self.obj()
            else:
                ex = []
                while self.i < len(self.s) and self.peek() != "]":
                    if self.peek() == '"':
                        ex.append(self.quoted())
                    else:
                        self.i += 1
                if ex:
                    it["examples"] = ex
            while self.i < len(self.s) and self.peek() != "]":
                self.i += 1
            self.i += 1
        elif c == '"':
            it["consts"].append(self.quoted())
            while self.peek() == "|":
                self.i += 1
                it["consts"].append(self.quoted())
        else:
            # A range "LO–HI" with an optional "(default D)" or "(D)"; or "(D, max HI)".
            rest = self.s[self.i:]
            m = re.match(r"([0-9.]+)–([0-9.]+)(?: \((?:default )?([0-9.]+)\))?", rest)
            m2 = re.match(r"\(([0-9.]+), max ([0-9.]+)\)", rest)
            if m:
                it["min"], it["max"] = float(m.group(1)), float(m.group(2))
                if m.group(3):
                    it["default"] = float(m.group(3))
                self.i += m.end()
            elif m2:
                it["default"], it["max"] = float(m2.group(1)), float(m2.group(2))
                self.i += m2.end()
        # Skip to the end of this item.
        while self.i < len(self.s) and self.peek() not in ",}" and not self.s.startswith(" or ", self.i):
            self.i += 1
        return it

    def quoted(self):
        assert self.peek() == '"'
        j = self.s.index('"', self.i + 1)
        v = self.s[self.i + 1:j]
        self.i = j + 1
        return v


def parse_spec(text):
    return Spec(text).parse()


def md_routes(md):
    """{(METHOD, path): {"row": (cell0, cell1) or None, "scope": annotation or None}}."""
    routes = {}
    for c0, c1 in md_rows(md):
        found = ROUTE_RE.findall(c0)
        ann = re.search(r"\(([a-z]+:[a-z]+|admin)\)", c0)
        for method, path in found:
            path = path.split("?")[0]
            routes[(method, path)] = {"row": (c0, c1), "scope": ann.group(1) if ann else None,
                                      "combined": len(found) > 1}
    for method, path in re.findall(r"`(GET|POST|PUT|DELETE|PATCH) (/[^`\s]*)`",
                                   md_section(md, "Operations")):
        routes.setdefault((method, path), {"row": None, "scope": None, "combined": False})
    return routes


def md_public_paths(md):
    bullet = md_bullet(md_section(md, "Conventions"), "`Authorization: Bearer")
    m = re.search(r"Every route but (.*?) needs one", bullet)
    if not m:
        return None
    return set(re.findall(r"`(/[^`]*)`", m.group(1)))


def md_error_codes(md):
    bullet = md_bullet(md_section(md, "Conventions"), "Every response carries")
    pairs = set()
    for m in re.finditer(r"(\d{3})\s+`([a-z_]+)`(?:\s+or\s+`([a-z_]+)`)?", bullet):
        pairs.add((int(m.group(1)), m.group(2)))
        if m.group(3):
            pairs.add((int(m.group(1)), m.group(3)))
    return pairs


def md_scopes(md):
    """{scope: set of /v1 paths named for it} from the Conventions bullet on scopes."""
    bullet = md_bullet(md_section(md, "Conventions"), "Scopes:")
    out = {}
    for m in re.finditer(r"`([a-z]+:[a-z]+|admin)` \(([^)]*)\)", bullet):
        out[m.group(1)] = set(p.rstrip(",") for p in re.findall(r"/v1/[a-z/.-]+[a-z]", m.group(2)))
    return out


def md_id_prefixes(md):
    bullet = md_bullet(md_section(md, "Conventions"), "Ids are")
    return set(re.findall(r"`([a-z]+_)`", bullet))


# ------------------------------------------------------------------------------------------------
# Cross-checks


def check_fields(d, items, schema, where, op_key, request, prefix=""):
    if items is None:
        return  # API.md leaves these fields open
    props, required = d.fields(schema)
    names = set()
    for it in items:
        name = it["name"]
        names.add(name)
        label = "%s: field %s%s" % (where, prefix, name)
        if name not in props:
            d.err("%s is in API.md but not in the document" % label)
            continue
        if request and not it["alt"]:
            if it["optional"] and name in required:
                d.err("%s is optional in API.md but required in the document" % label)
            if not it["optional"] and name not in required:
                d.err("%s is required in API.md but optional in the document" % label)
        if not request and not it["optional"] and name not in required:
            d.err("%s is always present per API.md but not required in the document" % label)
        p = d.flatten(props[name])
        if it["array"] and p.get("type") != "array":
            d.err("%s is an array in API.md, %s in the document" % (label, p.get("type")))
        consts = [c for c in it["consts"] if c != "…"]
        if len(consts) > 1 and set(p.get("enum", [])) != set(consts):
            d.err("%s: enum %s in API.md, %s in the document" % (label, consts, p.get("enum")))
        if len(consts) == 1 and consts[0] not in p.get("enum", []) and p.get("default") != consts[0]:
            d.err("%s: API.md's %r is neither its default nor in its enum" % (label, consts[0]))
        for key, oa in (("min", "minimum"), ("max", "maximum"), ("default", "default")):
            if key in it and (not isinstance(p.get(oa), (int, float)) or float(p[oa]) != it[key]):
                d.err("%s: %s %g in API.md, %r in the document" % (label, oa, it[key], p.get(oa)))
        if it["examples"] is not None and p.get("example") != it["examples"]:
            d.err("%s: example %s in API.md, %s in the document" % (label, it["examples"], p.get("example")))
        if it["children"] is not None:
            sub = d.flatten(p.get("items")) if p.get("type") == "array" else p
            check_fields(d, it["children"], sub, where, op_key, request,
                         prefix + name + ("[]." if p.get("type") == "array" else "."))
    for name in sorted(set(props) - names):
        if (op_key, prefix + name) in EXTRA_FIELDS:
            continue
        d.err("%s: field %s%s is in the document but not in API.md" % (where, prefix, name))


def success_of(op):
    return sorted(s for s in (op.get("responses") or {}) if str(s).startswith("2"))


def check_against_md(d, md):
    routes = md_routes(md)
    public = md_public_paths(md)
    if not routes:
        d.err("API.md: no \"METHOD /path\" rows found")
    if not public:
        d.err("API.md: the list of routes that need no credential was not found")
        public = set()

    ops = {(m, p): (op, item) for p, m, op, item in d.operations()}
    expected = set(routes) | {("GET", p) for p in public if not any(r[1] == p for r in routes)}
    for r in sorted(expected - set(ops)):
        d.err("%s %s is in API.md but not in the document" % r)
    for r in sorted(set(ops) - expected):
        d.err("%s %s is in the document but not in API.md" % r)
    for p in sorted(public):
        if not any(k[1] == p for k in ops):
            d.err("public route %s of API.md is not in the document" % p)

    # Scopes: the names, the rule, and each route.
    scope_enum = set((d.flatten({"$ref": "#/components/schemas/Scope"})).get("enum", []))
    named = md_scopes(md)
    if set(named) != scope_enum:
        d.err("scopes: API.md names %s, the document %s" % (sorted(named), sorted(scope_enum)))
    for s, paths in named.items():
        if API_MD_SCOPE_PATHS.get(s) != paths:
            d.err("scopes: API.md gives %s the paths %s; the checker's rule expects %s (update "
                  "expected_scope() with the contract)" % (s, sorted(paths), sorted(API_MD_SCOPE_PATHS.get(s, []))))
    for (method, path), info in sorted(routes.items()):
        if path in public:
            continue
        rule = expected_scope(method, path)
        if rule is None:
            d.err("%s %s: no scope rule in API.md's Conventions covers it" % (method, path))
            continue
        if info["scope"] and info["scope"] != rule[0]:
            d.err("%s %s: API.md's row says (%s), its Conventions say %s"
                  % (method, path, info["scope"], rule[0]))
        if (method, path) not in ops:
            continue
        op = ops[(method, path)][0]
        if op.get("x-kiln-scope") != rule[0]:
            d.err("%s %s: x-kiln-scope %r, API.md says %r" % (method, path, op.get("x-kiln-scope"), rule[0]))
        if rule[1] and op.get("x-kiln-narrowing-scope") != rule[1]:
            d.err("%s %s: x-kiln-narrowing-scope must be %r" % (method, path, rule[1]))

    # Error codes and their statuses.
    pairs = md_error_codes(md)
    ec = d.flatten({"$ref": "#/components/schemas/ErrorCode"})
    have = {(int(s), c) for c, s in (ec.get("x-kiln-http-status") or {}).items()}
    if not pairs:
        d.err("API.md: no error codes found in Conventions")
    for p in sorted(pairs - have):
        d.err("error %s %s is in API.md but not in the document" % p)
    for p in sorted(have - pairs):
        d.err("error %s %s is in the document but not in API.md" % p)
    used = set()
    for _, _, op, _ in d.operations():
        for status, resp in (op.get("responses") or {}).items():
            codes = error_codes_of(d, d.resolve(resp) or {}) or set()
            used |= {(int(status), c) for c in codes}
    for p in sorted(pairs - used):
        d.err("error %s %s is never answered by any operation" % p)

    # Id prefixes.
    patterns = {d.flatten(s).get("pattern") for s in ((d.doc.get("components") or {}).get("schemas") or {}).values()}
    for prefix in sorted(md_id_prefixes(md)):
        if "^" + prefix not in patterns:
            d.err("no schema for ids with API.md's prefix %s" % prefix)

    # Each row: credential, statuses, query parameters, bodies, enums.
    for (method, path), info in sorted(routes.items()):
        if (method, path) not in ops or info["row"] is None:
            continue
        op, item = ops[(method, path)]
        key = "%s %s" % (method, path)
        c0, c1 = info["row"]
        responses = {str(s) for s in op.get("responses") or {}}
        left, arrow, right = c1.partition("→")
        if c1.startswith("(API key)"):
            if op.get("x-kiln-credential") != "api_key" or op.get("security") != [{"apiKey": []}]:
                d.err("%s: API.md requires an API key; the document must say x-kiln-credential: "
                      "api_key and security apiKey only" % key)
        if "no credential" in c1 and op.get("security") != []:
            d.err("%s: API.md says no credential is needed" % key)
        if info["combined"]:
            continue
        m = re.match(r"\s*(\d{3})\b", right)
        want = m.group(1) if m else {"GET": "200", "DELETE": "204"}.get(method)
        if want and success_of(op) != [want]:
            d.err("%s: success status %s in API.md, %s in the document" % (key, want, success_of(op)))
        for extra in re.findall(r"\b(\d{3}) if\b", right):
            if extra not in responses:
                d.err("%s: API.md answers %s, the document does not" % (key, extra))
        params = [d.resolve(p) or {} for p in item.get("parameters", []) + op.get("parameters", [])]
        for span in re.findall(r"`([^`]*)`", left):
            if span.startswith("?"):
                for name, val in re.findall(r"[?&]([a-z_]+)=([^&]*)", span):
                    q = [p for p in params if p.get("in") == "query" and p.get("name") == name]
                    if not q:
                        d.err("%s: query parameter %s of API.md is not in the document" % (key, name))
                    elif val and (d.flatten(q[0].get("schema")).get("default") != val
                                  and val != "/abs/path"):
                        d.err("%s: query %s=%s in API.md, default %r in the document"
                              % (key, name, val, d.flatten(q[0].get("schema")).get("default")))
            elif span.startswith("{"):
                body = d.resolve(op.get("requestBody")) or {}
                schema = ((body.get("content") or {}).get(JSON) or {}).get("schema")
                if schema is None:
                    d.err("%s: API.md gives a JSON body, the document none" % key)
                else:
                    check_fields(d, parse_spec(span), schema, key + " request", key, True)
            elif span == "Idempotency-Key":
                k = [p for p in params if p.get("name") == "Idempotency-Key"]
                if not k or not k[0].get("required"):
                    d.err("%s: API.md requires Idempotency-Key; the document must too" % key)
        for qname in re.findall(r"\?([a-z_]+)=/", c0):
            q = [p for p in params if p.get("in") == "query" and p.get("name") == qname]
            if not q or not q[0].get("required"):
                d.err("%s: query parameter %s must be required" % (key, qname))
        spans = [s for s in re.findall(r"`([^`]*)`", right) if s.startswith("{")]
        ok = [s for s in success_of(op)]
        if spans and ok:
            r = d.resolve(op["responses"][ok[0]]) or {}
            schema = ((r.get("content") or {}).get(JSON) or {}).get("schema")
            if schema is None:
                d.err("%s: API.md gives a JSON answer, the document none" % key)
            else:
                check_fields(d, parse_spec(spans[0]), schema, key + " response", key, False)
                props, _ = d.fields(schema)
                for name, values in re.findall(r"\b([a-z_]+) ∈ ([a-z_, ]+)", right):
                    enum = d.flatten(props.get(name, {})).get("enum")
                    if set(enum or []) != {v.strip() for v in values.split(",")}:
                        d.err("%s: %s ∈ {%s} in API.md, %s in the document" % (key, name, values, enum))
                m = re.search(r"\bstatus `(\w+)`((?:\s*(?:→|\(or)\s*`\w+`)*)", right)
                if m:
                    want_states = {m.group(1)} | set(re.findall(r"`(\w+)`", m.group(2)))
                    enum = d.flatten(props.get("status", {})).get("enum")
                    if set(enum or []) != want_states:
                        d.err("%s: status %s in API.md, %s in the document" % (key, sorted(want_states), enum))
        if "raw body" in c1:
            m = re.search(r"≤ (\d+) MiB", c1)
            body = d.resolve(op.get("requestBody")) or {}
            raw = (body.get("content") or {}).get("application/octet-stream")
            if not raw:
                d.err("%s: API.md takes a raw body; the document must take application/octet-stream" % key)
            elif m and (d.flatten(raw.get("schema")).get("x-kiln-max-bytes") != int(m.group(1)) * MIB):
                d.err("%s: the raw body cap must be %s MiB (x-kiln-max-bytes)" % (key, m.group(1)))
        if "raw bytes" in c1:
            r = d.resolve((op.get("responses") or {}).get("200")) or {}
            if "application/octet-stream" not in (r.get("content") or {}):
                d.err("%s: API.md answers raw bytes; the document must answer application/octet-stream" % key)
        if "text/event-stream" in c1:
            r = d.resolve((op.get("responses") or {}).get("200")) or {}
            sse = (r.get("content") or {}).get("text/event-stream")
            m = re.search(r"events (.*)", c1)
            events = set(re.findall(r"`(\w+)`", m.group(1))) if m else set()
            if not sse:
                d.err("%s: API.md streams text/event-stream; the document does not" % key)
            elif not events <= set(sse.get("x-kiln-sse-events") or {}):
                d.err("%s: events %s in API.md, %s in the document"
                      % (key, sorted(events), sorted(sse.get("x-kiln-sse-events") or {})))

    # GET /healthz: 200 and 503, and a body that says which check failed.
    if ("GET", "/healthz") in ops:
        op = ops[("GET", "/healthz")][0]
        for s in ("200", "503"):
            r = d.resolve((op.get("responses") or {}).get(s)) or {}
            schema = ((r.get("content") or {}).get(JSON) or {}).get("schema")
            h = d.flatten(schema) if schema else {}
            props = h.get("properties") or {}
            if set(d.flatten(props.get("status", {})).get("enum", [])) != {"ok", "unavailable"}:
                d.err("GET /healthz %s: status must be ok or unavailable" % s)
            checks = d.flatten(props.get("checks", {}))
            cp = checks.get("properties") or {}
            if set(cp) != {"postgres", "redis", "nodes"} or set(checks.get("required", [])) != set(cp):
                d.err("GET /healthz %s: checks must be postgres, redis and nodes, all required" % s)
            for name, c in cp.items():
                if set(d.flatten(c).get("enum", [])) != {"ok", "unavailable"}:
                    d.err("GET /healthz %s: checks.%s must be ok or unavailable" % (s, name))


def check(doc, md):
    d = Doc(doc)
    if not isinstance(doc, dict):
        return ["the document is not a mapping"]
    public = md_public_paths(md) or set()
    check_structure(d, public)
    check_against_md(d, md)
    return d.errors


# ------------------------------------------------------------------------------------------------
# Self-test: each planted fault must be reported.


def self_test(doc, md, yaml_path, md_path):
    failures = []
    count = [0]

    def expect(label, doc2, md2, needle):
        count[0] += 1
        errs = check(doc2, md2)
        if not any(needle in e for e in errs):
            failures.append("%s: not caught (wanted %r; got %s)" % (label, needle, errs[:3]))

    count[0] += 1
    base = check(doc, md)
    if base:
        failures.append("the unchanged document does not pass: %s" % base[:3])

    def mut(fn):
        d2 = copy.deepcopy(doc)
        fn(d2)
        return d2

    P = lambda d2: d2["paths"]
    S = lambda d2: d2["components"]["schemas"]
    R = lambda d2: d2["components"]["responses"]
    expect("a route dropped", mut(lambda d2: P(d2).pop("/v1/sandboxes/{id}/fork")), md,
           "POST /v1/sandboxes/{id}/fork is in API.md but not in the document")
    expect("a route added", mut(lambda d2: P(d2).__setitem__("/v1/extra", copy.deepcopy(P(d2)["/v1/audit"]))),
           md, "GET /v1/extra is in the document but not in API.md")
    expect("a combined row's route dropped", mut(lambda d2: P(d2)["/v1/snapshots/{id}"].pop("delete")), md,
           "DELETE /v1/snapshots/{id} is in API.md")
    expect("the dashboard dropped", mut(lambda d2: P(d2).pop("/")), md, "public route / of API.md")
    expect("a wrong scope", mut(lambda d2: P(d2)["/v1/sandboxes"]["get"].__setitem__("x-kiln-scope", "sandbox:write")),
           md, "x-kiln-scope 'sandbox:write', API.md says 'sandbox:read'")
    expect("no scope", mut(lambda d2: P(d2)["/v1/usage"]["get"].pop("x-kiln-scope")), md, "has no x-kiln-scope")
    expect("no security", mut(lambda d2: P(d2)["/v1/sandboxes"]["post"].pop("security")), md, "no security")
    expect("a public route secured", mut(lambda d2: P(d2)["/healthz"]["get"].__setitem__("security", [{"apiKey": []}])),
           md, "a public route must have security: []")
    expect("no X-Request-Id", mut(lambda d2: R(d2)["NotFound"]["headers"].pop("X-Request-Id")), md,
           "no X-Request-Id header")
    expect("no Retry-After", mut(lambda d2: R(d2)["RateLimited"]["headers"].pop("Retry-After")), md,
           "no Retry-After header")
    expect("a broken $ref", mut(lambda d2: P(d2)["/v1/audit"]["get"]["responses"].__setitem__(
        "404", {"$ref": "#/components/responses/Nope"})), md, "does not resolve")
    expect("no responses", mut(lambda d2: P(d2)["/v1/audit"]["get"].__setitem__("responses", {})), md, "no responses")
    expect("a code under the wrong status", mut(lambda d2: P(d2)["/v1/audit"]["get"]["responses"].__setitem__(
        "400", {"$ref": "#/components/responses/NotFound"})), md, "code not_found belongs to status 404")
    expect("an error code dropped", mut(lambda d2: (S(d2)["ErrorCode"]["enum"].remove("no_capacity"),
                                                  S(d2)["ErrorCode"]["x-kiln-http-status"].pop("no_capacity"))),
           md, "error 503 no_capacity is in API.md but not in the document")
    expect("no Idempotency-Key", mut(lambda d2: P(d2)["/v1/sandboxes/{id}/pause"]["post"].__setitem__(
        "parameters", [{"$ref": "#/components/parameters/SandboxIdPath"}])), md, "without the Idempotency-Key")
    expect("grants' key optional", mut(lambda d2: P(d2)["/v1/billing/grants"]["post"].__setitem__(
        "parameters", [{"$ref": "#/components/parameters/IdempotencyKey"}])), md, "requires Idempotency-Key")
    expect("a range changed", mut(lambda d2: S(d2)["Vcpus"].__setitem__("maximum", 16)), md, "maximum 8 in API.md")
    expect("a default changed", mut(lambda d2: S(d2)["CreateSandboxRequest"]["properties"]["memory_mib"].__setitem__(
        "default", 1024)), md, "default 512 in API.md")
    expect("a field dropped", mut(lambda d2: S(d2)["Sandbox"]["properties"].pop("parent_id")), md,
           "field parent_id is in API.md but not in the document")
    expect("a field added", mut(lambda d2: S(d2)["ExecResult"]["properties"].__setitem__("signal", {"type": "integer"})),
           md, "field signal is in the document but not in API.md")
    expect("an enum changed", mut(lambda d2: S(d2)["Egress"]["properties"]["mode"].__setitem__("enum", ["open"])), md,
           "field mode: enum")
    expect("a state dropped", mut(lambda d2: S(d2)["SandboxState"]["enum"].remove("error")), md, "state ∈")
    expect("a snapshot status dropped", mut(lambda d2: S(d2)["SnapshotStatus"]["enum"].remove("uploading")), md,
           "status ['failed', 'local', 'stored', 'uploading'] in API.md")
    expect("an SSE event dropped", mut(lambda d2: P(d2)["/v1/sandboxes/{id}/exec"]["post"]["responses"]["200"]["content"]
                                       ["text/event-stream"]["x-kiln-sse-events"].pop("exit")), md, "events")
    expect("files not raw", mut(lambda d2: P(d2)["/v1/sandboxes/{id}/files"]["put"]["requestBody"].__setitem__(
        "content", {JSON: {"schema": {"type": "object", "additionalProperties": False}}})), md, "raw body")
    expect("a health check dropped", mut(lambda d2: S(d2)["Health"]["properties"]["checks"]["properties"].pop("nodes")),
           md, "checks must be postgres, redis and nodes")
    expect("tokens open to JWTs", mut(lambda d2: P(d2)["/v1/tokens"]["post"].__setitem__("security", [{"apiKey": []}, {"jwt": []}])),
           md, "API.md requires an API key")
    expect("an unknown request field allowed", mut(lambda d2: S(d2)["ForkRequest"].pop("additionalProperties")), md,
           "allows unknown fields")
    expect("an unused component", mut(lambda d2: S(d2).__setitem__("Orphan", {"type": "string"})), md,
           "components/schemas/Orphan is never used")
    expect("a row added to API.md", doc, md.replace("| GET /v1/audit |", "| GET /v1/widgets | → 200 |\n| GET /v1/audit |"),
           "GET /v1/widgets is in API.md but not in the document")
    expect("a scope moved in API.md", doc, md.replace("`billing:read` (/v1/billing/balance", "`billing:read` (/v1/storage, /v1/billing/balance"),
           "update expected_scope()")
    expect("an error code added to API.md", doc, md.replace("500 `internal`", "500 `internal`, 507 `full`"),
           "error 507 full is in API.md but not in the document")
    count[0] += 2
    try:
        load_yaml("a: 1\na: 2\n")
        failures.append("a duplicate YAML key: not caught")
    except yaml.YAMLError:
        pass
    rc = main_check(yaml_path, md_path + ".absent", quiet=True)
    if rc == 0:
        failures.append("a missing API.md: not a failure")

    for f in failures:
        print("FAIL " + f)
    print("%d passed, %d failed" % (count[0] - len(failures), len(failures)))
    return 1 if failures else 0


def read(path, what, quiet=False):
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError as e:
        if not quiet:
            sys.stderr.write("check_openapi: cannot read %s %s: %s\n" % (what, path, e.strerror))
        return None


def main_check(yaml_path, md_path, quiet=False):
    text = read(yaml_path, "the OpenAPI document", quiet)
    md = read(md_path, "the API contract (API.md)", quiet)
    if md is None and not quiet:
        sys.stderr.write("check_openapi: the cross-check against API.md cannot run; it is required\n")
    if text is None or md is None:
        return 2
    try:
        doc = load_yaml(text)
    except yaml.YAMLError as e:
        if not quiet:
            sys.stderr.write("check_openapi: %s does not parse: %s\n" % (yaml_path, e))
        return 2
    errors = check(doc, md)
    if not quiet:
        for e in errors:
            print("FAIL " + e)
        n_ops = sum(1 for _ in Doc(doc).operations())
        if errors:
            print("%s: %d problem(s)" % (yaml_path, len(errors)))
        else:
            print("%s: %d operations agree with %s" % (yaml_path, n_ops, md_path))
    return 1 if errors else 0


def main(argv):
    if len(argv) == 4 and argv[1] == "--self-test":
        text, md = read(argv[2], "the OpenAPI document"), read(argv[3], "the API contract (API.md)")
        if text is None or md is None:
            return 2
        return self_test(load_yaml(text), md, argv[2], argv[3])
    if len(argv) != 3:
        sys.stderr.write(__doc__)
        return 2
    return main_check(argv[1], argv[2])


if __name__ == "__main__":
    sys.exit(main(sys.argv))
