#!/usr/bin/python3
"""
check_openapi.py - checks docs/openapi.yaml on its own and against the code that serves it.

    check_openapi.py OPENAPI_YAML SOURCE_DIR              check the document; exit 0 when it passes
    check_openapi.py --self-test OPENAPI_YAML SOURCE_DIR  check that the checks catch planted faults

docs/openapi.yaml is the API's contract. The document must be well-formed (every $ref resolves,
every operation has responses, an X-Request-Id header on every response, security and x-kiln-scope
where a credential is needed, x-kiln-access (public, tenant or admin, as its security and scope
say) on every operation, x-kiln-object on the schema of every path parameter, error responses
whose codes belong to their status, strict request bodies, the health body) and must agree with
the source tree SOURCE_DIR:

  - routes: the route groups kiln-gateway installs (api/gateway.c, routes_init()) and the
    `struct http_route` tables behind them (api/routes_*.c). Every registered METHOD /path is
    documented and every documented one is registered, but for DASHBOARD_FILES below. kiln-node's
    routes (node/) are served on its Unix socket to the gateway only and are not public.
  - credentials: a route with scope 0 is public (security: []); ROUTE_AUTH routes name in
    x-kiln-scope the AUTH_SCOPE_* they need ("none" when they need none); ROUTE_API_KEY_ONLY
    routes take an API key only (x-kiln-credential: api_key).
  - scopes: the Scope enum holds auth/scopes.c's names.
  - error codes: ErrorCode and its x-kiln-http-status are the API codes and HTTP statuses of
    docs/errors.md's table of enum kiln_err (the codes common/err.h gives the wire).

Exit status: 0 all checks pass; 1 a check failed (one line per problem); 2 a file is missing or
cannot be parsed. Needs only Python 3 and PyYAML (Debian: python3-yaml).
"""
import copy
import glob
import os
import re
import sys

try:
    import yaml
except ImportError:
    sys.stderr.write("check_openapi: PyYAML is missing (Debian package python3-yaml)\n")
    sys.exit(2)

METHODS = ("get", "put", "post", "delete", "patch", "head", "options", "trace")
JSON = "application/json"

# Registered routes the document leaves out on purpose, each with its reason. Nothing else may be.
DASHBOARD_FILES = {
    ("GET", "/assets/{name}"): "the dashboard's static files (scripts, styles), described under GET /",
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
        # Every path parameter names the kind of object it refers to (tests/e2e/test_matrix.py
        # calls each operation on another tenant's object of that kind).
        for p in params:
            if p.get("in") == "path" and not d.flatten(p.get("schema")).get("x-kiln-object"):
                d.err("%s: path parameter %s: its schema has no x-kiln-object" % (name, p.get("name")))

        # Who may call it: public (no credential), tenant, or admin (the operator's scope only).
        access = op.get("x-kiln-access")
        want = ("public" if op.get("security") == [] else
                "admin" if op.get("x-kiln-scope") == "admin" else "tenant")
        if access not in ("public", "tenant", "admin"):
            d.err("%s: x-kiln-access must be public, tenant or admin, not %r" % (name, access))
        elif access != want:
            d.err("%s: x-kiln-access %s, but its security and x-kiln-scope make it %s"
                  % (name, access, want))

        # Responses.
        responses = op.get("responses") or {}
        if not responses:
            d.err("%s: no responses" % name)
        if not any(str(s).startswith("2") or str(s) == "101" for s in responses):
            d.err("%s: no 2xx (or 101 Switching Protocols) response" % name)
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
# The code: what kiln-gateway registers, its scopes and its error codes


class Source:
    """The files of SOURCE_DIR the checks read, as {relative path: text}, and what is read from
    them. A table or list that cannot be found is an error, never an empty result."""

    FILES = ("api/gateway.c", "auth/scopes.h", "auth/scopes.c", "docs/errors.md")

    def __init__(self, files):
        self.files = files
        self.errors = []

    @staticmethod
    def load(root):
        files = {}
        for path in sorted(glob.glob(os.path.join(root, "api", "*.c"))):
            files[os.path.relpath(path, root)] = None
        for rel in Source.FILES:
            files[rel] = None
        for rel in files:
            try:
                with open(os.path.join(root, rel), encoding="utf-8") as f:
                    files[rel] = f.read()
            except OSError as e:
                sys.stderr.write("check_openapi: cannot read %s: %s\n"
                                 % (os.path.join(root, rel), e.strerror))
                return None
        return Source(files)

    def err(self, msg):
        self.errors.append(msg)

    def text(self, rel):
        """The file without its comments ("" and an error when it is not there)."""
        t = self.files.get(rel)
        if t is None:
            self.err("%s: not in the source tree" % rel)
            return ""
        t = re.sub(r"/\*.*?\*/", lambda m: "\n" * m.group(0).count("\n"), t, flags=re.S)
        return re.sub(r"//[^\n]*", "", t)

    def scope_bits(self):
        """{AUTH_SCOPE_NAME: scope name} from auth/scopes.h's bits and auth/scopes.c's names."""
        bits = re.findall(r"#define\s+(AUTH_SCOPE_[A-Z_]+)\s+\(1u?\s*<<\s*(\d+)\)",
                          self.text("auth/scopes.h"))
        m = re.search(r"scope_names\s*\[[^]]*\]\s*=\s*\{(.*?)\}", self.text("auth/scopes.c"), re.S)
        names = re.findall(r'"([^"]+)"', m.group(1)) if m else []
        if not bits or not names:
            self.err("auth/scopes.h, auth/scopes.c: the scope bits or scope_names[] were not found")
            return {}
        out = {}
        for macro, bit in bits:
            if int(bit) >= len(names):
                self.err("auth/scopes.h: %s is bit %s, scope_names[] has %d names"
                         % (macro, bit, len(names)))
                continue
            out[macro] = names[int(bit)]
        return out

    def routes(self):
        """{(METHOD, path): set of the scope field's flags} of the groups routes_init() installs."""
        m = re.search(r"route_group\s*\*\s*groups\s*\[\s*\]\s*=\s*\{(.*?)\}",
                      self.text("api/gateway.c"), re.S)
        groups = re.findall(r"&\s*(\w+)", m.group(1)) if m else []
        if not groups:
            self.err("api/gateway.c: routes_init()'s list of route groups was not found")
            return {}
        defs = {}
        for rel in self.files:
            if not rel.startswith("api/") or not rel.endswith(".c"):
                continue
            for g, table in re.findall(r"const\s+struct\s+route_group\s+(\w+)\s*=\s*\{\s*(\w+)\s*,",
                                       self.text(rel)):
                defs[g] = (rel, table)
        out = {}
        for g in groups:
            if g not in defs:
                self.err("api/gateway.c installs %s, which no api/*.c defines" % g)
                continue
            rel, table = defs[g]
            t = self.text(rel)
            m = re.search(r"struct\s+http_route\s+%s\s*\[\s*\]\s*=\s*\{(.*?)\n\s*\}\s*;"
                          % re.escape(table), t, re.S)
            if not m:
                self.err("%s: the table %s of %s was not found" % (rel, table, g))
                continue
            body = m.group(1)
            entries = re.findall(r'\{\s*"([A-Z]+)"\s*,\s*"([^"]*)"\s*,\s*\w+\s*,\s*([^,]+?)\s*,', body)
            n = len(re.findall(r"\{", re.sub(r'"[^"]*"', '""', body)))
            if len(entries) != n or not entries:
                self.err("%s: %s has entries this checker cannot read (%d of %d)"
                         % (rel, table, len(entries), n))
            for method, path, scope in entries:
                flags = {f.strip() for f in scope.split("|")} - {"0"}
                if (method, path) in out:
                    self.err("%s: %s %s is registered twice" % (rel, method, path))
                out[(method, path)] = flags
        return out

    def error_codes(self):
        """{wire code: HTTP status} from docs/errors.md's table of enum kiln_err (its "API `code`"
        and "HTTP" columns, found by their headings)."""
        cols, out = None, {}
        for line in self.files.get("docs/errors.md", "").splitlines():
            if not line.startswith("|"):
                continue
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if cols is None:
                if "API `code`" in cells and "HTTP" in cells:
                    cols = (cells.index("API `code`"), cells.index("HTTP"))
                continue
            if set("".join(cells)) <= set("-: ") or len(cells) <= max(cols):
                continue
            code, status = cells[cols[0]], cells[cols[1]]
            if code in ("—", "-", ""):
                continue
            if not re.fullmatch(r"[a-z_]+", code) or not re.fullmatch(r"[1-5][0-9][0-9]", status):
                self.err("docs/errors.md: cannot read the row %r" % line)
                continue
            if out.get(code, int(status)) != int(status):
                self.err("docs/errors.md: %s has statuses %s and %s" % (code, out[code], status))
            out[code] = int(status)
        if not out:
            self.err("docs/errors.md: the table of error codes (API `code`, HTTP) was not found")
        return out


def check_against_code(d, src):
    """Reports on `d` where the document and the source disagree (routes, credentials, scopes,
    error codes), and anything of the source that could not be read. Returns the public routes."""
    routes = src.routes()
    if not routes and not src.errors:
        src.err("api/: kiln-gateway registers no routes")
    scope_of = src.scope_bits()
    ops = {(m, p): op for p, m, op, _ in d.operations()}

    for r in sorted(set(routes) - set(ops) - set(DASHBOARD_FILES)):
        d.err("%s %s is registered by kiln-gateway but not in the document" % r)
    for r in sorted(set(ops) - set(routes)):
        d.err("%s %s is in the document but registered by no code" % r)
    for r in sorted(set(DASHBOARD_FILES) & set(ops)):
        d.err("%s %s is documented, but DASHBOARD_FILES says it is left out: drop it there" % r)
    for r in sorted(set(DASHBOARD_FILES) - set(routes)):
        d.err("%s %s is in DASHBOARD_FILES but registered by no code" % r)

    known = {"ROUTE_AUTH", "ROUTE_API_KEY_ONLY", "ROUTE_CREATES"} | set(scope_of)
    for (method, path), flags in sorted(routes.items()):
        key = "%s %s" % (method, path)
        for f in sorted(flags - known):
            d.err("%s: its scope field has %s, which this checker does not know" % (key, f))
        if (method, path) not in ops:
            continue
        op = ops[(method, path)]
        if not flags:
            if op.get("security") != []:
                d.err("%s: the code serves it without a credential; the document must say "
                      "security: []" % key)
            continue
        if "ROUTE_AUTH" not in flags:
            d.err("%s: a scope without ROUTE_AUTH in the code" % key)
        scopes = sorted(scope_of[f] for f in flags if f in scope_of)
        want = scopes[0] if len(scopes) == 1 else ("none" if not scopes else " ".join(scopes))
        if op.get("x-kiln-scope") != want:
            d.err("%s: x-kiln-scope %r, the code asks for %r" % (key, op.get("x-kiln-scope"), want))
        if op.get("security") == []:
            d.err("%s: the code needs a credential; the document says security: []" % key)
        key_only = "ROUTE_API_KEY_ONLY" in flags
        if key_only and (op.get("x-kiln-credential") != "api_key"
                         or op.get("security") != [{"apiKey": []}]):
            d.err("%s: the code takes an API key only; the document must say x-kiln-credential: "
                  "api_key and security apiKey only" % key)
        if not key_only and op.get("x-kiln-credential") == "api_key":
            d.err("%s: x-kiln-credential: api_key, but the code takes a JWT too" % key)

    # Scopes.
    scope_enum = d.flatten({"$ref": "#/components/schemas/Scope"}).get("enum", [])
    if scope_of and sorted(scope_enum) != sorted(scope_of.values()):
        d.err("Scope: the document names %s, auth/scopes.c %s"
              % (sorted(scope_enum), sorted(scope_of.values())))

    # Error codes and their statuses, and each answered by some operation.
    codes = src.error_codes()
    ec = d.flatten({"$ref": "#/components/schemas/ErrorCode"})
    have = {c: s for c, s in (ec.get("x-kiln-http-status") or {}).items()}
    for c in sorted(set(codes) - set(have)):
        d.err("error %s %s is in docs/errors.md but not in the document" % (codes[c], c))
    for c in sorted(set(have) - set(codes)):
        d.err("error %s %s is in the document but not in docs/errors.md" % (have[c], c))
    for c in sorted(set(have) & set(codes)):
        if have[c] != codes[c]:
            d.err("error %s: status %s in the document, %s in docs/errors.md" % (c, have[c], codes[c]))
    used = set()
    for _, _, op, _ in d.operations():
        for status, resp in (op.get("responses") or {}).items():
            used |= error_codes_of(d, d.resolve(resp) or {}) or set()
    for c in sorted(set(have) - used):
        d.err("error %s is never answered by any operation" % c)

    # The code's own problems are the document's too: a table this checker cannot read fails.
    for e in src.errors:
        d.err(e)
    return {r for r, flags in routes.items() if not flags}


def check_health(d):
    """GET /healthz answers 200 and 503 with a body naming each check, ok or unavailable."""
    ops = {(m, p): (op, item) for p, m, op, item in d.operations()}
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




def check(doc, src):
    """Every problem of the document `doc` (parsed) against the source `src`, one line each."""
    if not isinstance(doc, dict):
        return ["the document is not a mapping"]
    d = Doc(doc)
    src.errors = []
    public = check_against_code(d, src)
    check_structure(d, {p for _, p in public})
    check_health(d)
    return d.errors


# ------------------------------------------------------------------------------------------------
# Self-test: each planted fault must be reported.


def self_test(doc, src, yaml_path):
    failures = []
    count = [0]

    def expect(label, doc2, src2, needle):
        count[0] += 1
        errs = check(doc2, src2)
        if not any(needle in e for e in errs):
            failures.append("%s: not caught (wanted %r; got %s)" % (label, needle, errs[:3]))

    count[0] += 1
    base = check(doc, src)
    if base:
        failures.append("the unchanged document does not pass: %s" % base[:3])

    def mut(fn):
        d2 = copy.deepcopy(doc)
        fn(d2)
        return d2

    def code(*edits, add=None):
        """A copy of the source with each (file, old, new) edit made (`old` must be there) and the
        files of `add` added."""
        files = dict(src.files)
        for rel, old, new in edits:
            if old not in files[rel]:
                failures.append("self-test: %r is not in %s; update the planted fault" % (old, rel))
            files[rel] = files[rel].replace(old, new, 1)
        files.update(add or {})
        return Source(files)

    P = lambda d2: d2["paths"]
    S = lambda d2: d2["components"]["schemas"]
    R = lambda d2: d2["components"]["responses"]
    SB = "api/routes_sandboxes.c"

    # Routes: the document against the code.
    expect("a documented route dropped", mut(lambda d2: P(d2).pop("/v1/sandboxes/{id}/fork")), src,
           "POST /v1/sandboxes/{id}/fork is registered by kiln-gateway but not in the document")
    expect("an unregistered route documented", mut(lambda d2: P(d2).__setitem__(
        "/v1/extra", copy.deepcopy(P(d2)["/v1/audit"]))), src,
        "GET /v1/extra is in the document but registered by no code")
    expect("a method documented on a registered path",
           mut(lambda d2: P(d2)["/v1/audit"].__setitem__("delete", copy.deepcopy(P(d2)["/v1/audit"]["get"]))),
           src, "DELETE /v1/audit is in the document but registered by no code")
    expect("an undocumented route registered", doc,
           code((SB, '{ "GET", "/v1/sandboxes", sandbox_list,',
                '{ "GET", "/v1/sandboxes/{id}/logs", sandbox_list, ROUTE_AUTH, 0, NULL, 0 },\n'
                '\t{ "GET", "/v1/sandboxes", sandbox_list,')),
           "GET /v1/sandboxes/{id}/logs is registered by kiln-gateway but not in the document")
    expect("an undocumented route group installed", doc,
           code(("api/gateway.c", "&routes_billing };", "&routes_billing, &routes_extra };"),
                add={"api/routes_extra.c": 'static const struct http_route routes[] = {\n'
                     '\t{ "POST", "/v1/extra", extra, ROUTE_AUTH, 0, NULL, 0 },\n};\n'
                     'const struct route_group routes_extra = { routes, 1 };\n'}),
           "POST /v1/extra is registered by kiln-gateway but not in the document")
    expect("a group installed that nothing defines", doc,
           code(("api/gateway.c", "&routes_billing };", "&routes_billing, &routes_gone };")),
           "installs routes_gone, which no api/*.c defines")
    expect("a route group not installed", doc,
           code(("api/gateway.c", "&routes_storage, ", "")),
           "PUT /v1/storage is in the document but registered by no code")
    expect("a table the checker cannot read", doc,
           code(("api/routes_audit.c", '{ "GET", "/v1/audit", audit_list,', '{ GET_METHOD, "/v1/audit", audit_list,')),
           "has entries this checker cannot read")
    expect("the dashboard's files documented", mut(lambda d2: P(d2).__setitem__(
        "/assets/{name}", copy.deepcopy(P(d2)["/"]))), src, "DASHBOARD_FILES says it is left out")
    expect("the dashboard's page dropped", mut(lambda d2: P(d2).pop("/")), src,
           "GET / is registered by kiln-gateway but not in the document")

    # Credentials and scopes against the code.
    expect("a wrong scope", mut(lambda d2: P(d2)["/v1/sandboxes"]["get"].__setitem__("x-kiln-scope", "sandbox:write")),
           src, "x-kiln-scope 'sandbox:write', the code asks for 'sandbox:read'")
    expect("a scope changed in the code", doc,
           code(("api/routes_audit.c", "ROUTE_AUTH | AUTH_SCOPE_BILLING_READ", "ROUTE_AUTH | AUTH_SCOPE_ADMIN")),
           "GET /v1/audit: x-kiln-scope 'billing:read', the code asks for 'admin'")
    expect("a public route made private in the code", doc,
           code(("api/routes_ops.c", '"/metrics", metrics, 0,', '"/metrics", metrics, ROUTE_AUTH | AUTH_SCOPE_ADMIN,')),
           "GET /metrics: the code needs a credential")
    expect("a private route made public in the code", doc,
           code(("api/routes_audit.c", "ROUTE_AUTH | AUTH_SCOPE_BILLING_READ", "0")),
           "GET /v1/audit: the code serves it without a credential")
    expect("an API-key-only route open to JWTs",
           mut(lambda d2: P(d2)["/v1/tokens"]["post"].__setitem__("security", [{"apiKey": []}, {"jwt": []}])),
           src, "the code takes an API key only")
    expect("a route made API-key-only in the code", doc,
           code(("api/routes_audit.c", "ROUTE_AUTH | AUTH_SCOPE_BILLING_READ",
                "ROUTE_AUTH | ROUTE_API_KEY_ONLY | AUTH_SCOPE_BILLING_READ")),
           "GET /v1/audit: the code takes an API key only")
    expect("an unknown flag", doc, code(("api/routes_audit.c", "ROUTE_AUTH | AUTH_SCOPE_BILLING_READ",
                                        "ROUTE_AUTH | ROUTE_SOMETHING | AUTH_SCOPE_BILLING_READ")),
           "ROUTE_SOMETHING, which this checker does not know")
    expect("a scope added in the code", doc,
           code(("auth/scopes.c", '"admin",', '"admin", "nodes:write",'),
                ("auth/scopes.h", "#define AUTH_SCOPE_COUNT", "#define AUTH_SCOPE_NODES_WRITE (1u << 5)\n#define AUTH_SCOPE_COUNT")),
           "Scope: the document names")
    expect("a scope dropped from the document", mut(lambda d2: S(d2)["Scope"]["enum"].remove("admin")), src,
           "Scope: the document names")

    # Error codes against the code.
    expect("an error code dropped", mut(lambda d2: (S(d2)["ErrorCode"]["enum"].remove("no_capacity"),
                                                  S(d2)["ErrorCode"]["x-kiln-http-status"].pop("no_capacity"))),
           src, "error 503 no_capacity is in docs/errors.md but not in the document")
    expect("an error code renamed in docs/errors.md", doc,
           code(("docs/errors.md", "| too_large | 413 |", "| payload_too_large | 413 |")),
           "error 413 payload_too_large is in docs/errors.md but not in the document")
    expect("a status changed in docs/errors.md", doc,
           code(("docs/errors.md", "| quota_exceeded | 403 |", "| quota_exceeded | 402 |")),
           "error quota_exceeded: status 403 in the document, 402 in docs/errors.md")
    expect("the table of docs/errors.md gone", doc, code(("docs/errors.md", "| API `code` | HTTP |", "| API code | HTTP |")),
           "the table of error codes (API `code`, HTTP) was not found")
    expect("an error code in no document", mut(lambda d2: (S(d2)["ErrorCode"]["enum"].append("gone"),
                                                          S(d2)["ErrorCode"]["x-kiln-http-status"].__setitem__("gone", 410))),
           src, "error 410 gone is in the document but not in docs/errors.md")
    expect("an error code never answered", mut(lambda d2: [
        op["responses"].pop("501", None) for item in P(d2).values() for op in item.values()
        if isinstance(op, dict) and "responses" in op]), src, "error not_implemented is never answered")

    # Structure.
    expect("no scope", mut(lambda d2: P(d2)["/v1/usage"]["get"].pop("x-kiln-scope")), src, "has no x-kiln-scope")
    expect("no security", mut(lambda d2: P(d2)["/v1/sandboxes"]["post"].pop("security")), src, "no security")
    expect("a public route secured", mut(lambda d2: P(d2)["/healthz"]["get"].__setitem__("security", [{"apiKey": []}])),
           src, "a public route must have security: []")
    expect("no X-Request-Id", mut(lambda d2: R(d2)["NotFound"]["headers"].pop("X-Request-Id")), src,
           "no X-Request-Id header")
    expect("no Retry-After", mut(lambda d2: R(d2)["RateLimited"]["headers"].pop("Retry-After")), src,
           "no Retry-After header")
    expect("a broken $ref", mut(lambda d2: P(d2)["/v1/audit"]["get"]["responses"].__setitem__(
        "404", {"$ref": "#/components/responses/Nope"})), src, "does not resolve")
    expect("no responses", mut(lambda d2: P(d2)["/v1/audit"]["get"].__setitem__("responses", {})), src, "no responses")
    expect("a code under the wrong status", mut(lambda d2: P(d2)["/v1/audit"]["get"]["responses"].__setitem__(
        "400", {"$ref": "#/components/responses/NotFound"})), src, "code not_found belongs to status 404")
    expect("no Idempotency-Key", mut(lambda d2: P(d2)["/v1/sandboxes/{id}/pause"]["post"].__setitem__(
        "parameters", [{"$ref": "#/components/parameters/SandboxIdPath"}])), src, "without the Idempotency-Key")
    expect("a path parameter undeclared", mut(lambda d2: P(d2)["/v1/sandboxes/{id}/pause"]["post"].__setitem__(
        "parameters", [{"$ref": "#/components/parameters/IdempotencyKey"}])), src, "path parameters")
    expect("no x-kiln-access", mut(lambda d2: P(d2)["/v1/audit"]["get"].pop("x-kiln-access")), src,
           "x-kiln-access must be public, tenant or admin, not None")
    expect("an admin route marked tenant", mut(lambda d2: P(d2)["/v1/billing/grants"]["post"].__setitem__(
        "x-kiln-access", "tenant")), src, "x-kiln-access tenant, but its security and x-kiln-scope make it admin")
    expect("a tenant route marked public", mut(lambda d2: P(d2)["/v1/sandboxes/{id}"]["get"].__setitem__(
        "x-kiln-access", "public")), src, "x-kiln-access public, but its security and x-kiln-scope make it tenant")
    expect("a path parameter naming no object kind", mut(lambda d2: S(d2)["SnapshotId"].pop("x-kiln-object")),
           src, "path parameter id: its schema has no x-kiln-object")
    expect("a duplicate operationId", mut(lambda d2: P(d2)["/v1/audit"]["get"].__setitem__(
        "operationId", P(d2)["/v1/usage"]["get"]["operationId"])), src, "also used by")
    expect("a health check dropped", mut(lambda d2: S(d2)["Health"]["properties"]["checks"]["properties"].pop("nodes")),
           src, "checks must be postgres, redis and nodes")
    expect("an unknown request field allowed", mut(lambda d2: S(d2)["ForkRequest"].pop("additionalProperties")), src,
           "allows unknown fields")
    expect("an unused component", mut(lambda d2: S(d2).__setitem__("Orphan", {"type": "string"})), src,
           "components/schemas/Orphan is never used")
    expect("an amount not an integer", mut(lambda d2: S(d2)["Balance"]["properties"]["balance_ucr"].__setitem__(
        "type", "number")), src, "amounts are integers")
    expect("the wrong OpenAPI version", mut(lambda d2: d2.__setitem__("openapi", "3.1.0")), src, "openapi must be 3.0.3")
    expect("not a mapping", [], src, "not a mapping")
    count[0] += 2
    try:
        load_yaml("a: 1\na: 2\n")
        failures.append("a duplicate YAML key: not caught")
    except yaml.YAMLError:
        pass
    if main_check(yaml_path, os.path.join(os.path.dirname(yaml_path), "no-such-tree"), quiet=True) == 0:
        failures.append("a missing source tree: not a failure")

    for f in failures:
        print("FAIL " + f)
    print("%d passed, %d failed" % (count[0] - len(failures), len(failures)))
    return 1 if failures else 0


def main_check(yaml_path, root, quiet=False):
    try:
        with open(yaml_path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        if not quiet:
            sys.stderr.write("check_openapi: cannot read %s: %s\n" % (yaml_path, e.strerror))
        return 2
    if quiet:
        saved, sys.stderr = sys.stderr, open(os.devnull, "w")
    try:
        src = Source.load(root)
    finally:
        if quiet:
            sys.stderr.close()
            sys.stderr = saved
    if src is None:
        return 2
    try:
        doc = load_yaml(text)
    except yaml.YAMLError as e:
        if not quiet:
            sys.stderr.write("check_openapi: %s does not parse: %s\n" % (yaml_path, e))
        return 2
    errors = check(doc, src)
    if not quiet:
        for e in errors:
            print("FAIL " + e)
        if errors:
            print("%s: %d problem(s)" % (yaml_path, len(errors)))
        else:
            n_ops = sum(1 for _ in Doc(doc).operations())
            print("%s: %d operations agree with the routes kiln-gateway registers" % (yaml_path, n_ops))
    return 1 if errors else 0


def main(argv):
    if len(argv) == 4 and argv[1] == "--self-test":
        try:
            with open(argv[2], encoding="utf-8") as f:
                doc = load_yaml(f.read())
        except (OSError, yaml.YAMLError) as e:
            sys.stderr.write("check_openapi: %s: %s\n" % (argv[2], e))
            return 2
        src = Source.load(argv[3])
        if src is None:
            return 2
        return self_test(doc, src, argv[2])
    if len(argv) != 3:
        sys.stderr.write(__doc__)
        return 2
    return main_check(argv[1], argv[2])


if __name__ == "__main__":
    sys.exit(main(sys.argv))
