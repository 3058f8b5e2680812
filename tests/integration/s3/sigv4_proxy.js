// sigv4_proxy.js - a checking front for s3rver, which does not verify SigV4 signatures nor
// Content-MD5 itself. Every request is checked with the AWS SDK's own signer (@smithy/signature-v4)
// against the secret it is given: the signature over the signed headers, x-amz-content-sha256
// against the body's SHA-256 (unless UNSIGNED-PAYLOAD) and Content-MD5 against the body's MD5. A
// request that fails is answered as S3 would (403 SignatureDoesNotMatch, 400 BadDigest,
// XAmzContentSHA256Mismatch); one that passes goes to s3rver. One line per request goes to the
// log file: "<METHOD> <path?query> <status>", which the tests count.
//
//   node sigv4_proxy.js LISTEN_PORT UPSTREAM_PORT SECRET LOGFILE [LISTEN_HOST (127.0.0.1)]
"use strict";
const crypto = require("crypto");
const fs = require("fs");
const http = require("http");
const { SignatureV4 } = require("@smithy/signature-v4");

const [listenPort, upstreamPort, secret, logFile, listenHost] = process.argv.slice(2);

class Sha256 {
  constructor(key) { this.h = key ? crypto.createHmac("sha256", key) : crypto.createHash("sha256"); }
  update(d) { this.h.update(d); }
  async digest() { return new Uint8Array(this.h.digest()); }
}

function s3error(res, status, code, message) {
  res.writeHead(status, { "Content-Type": "application/xml" });
  res.end(`<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>${code}</Code>` +
          `<Message>${message}</Message></Error>`);
}

async function check(req, body) {
  const auth = req.headers["authorization"] || "";
  const m = /^AWS4-HMAC-SHA256 Credential=([^/]+)\/(\d{8})\/([^/]+)\/s3\/aws4_request, ?SignedHeaders=([^,]+), ?Signature=([0-9a-f]{64})$/.exec(auth);
  if (!m) return [403, "AccessDenied", "no SigV4 Authorization header"];
  const [, accessKeyId, , region, signedList, signature] = m;
  const signed = signedList.split(";");
  for (const h of ["host", "x-amz-date", "x-amz-content-sha256"])
    if (!signed.includes(h)) return [403, "AccessDenied", `${h} is not signed`];
  const sha = req.headers["x-amz-content-sha256"];
  const bodySha = crypto.createHash("sha256").update(body).digest("hex");
  if (sha !== "UNSIGNED-PAYLOAD" && sha !== bodySha)
    return [400, "XAmzContentSHA256Mismatch", "x-amz-content-sha256 does not match the body"];
  const md5 = req.headers["content-md5"];
  if (md5 !== undefined && md5 !== crypto.createHash("md5").update(body).digest("base64"))
    return [400, "BadDigest", "The Content-MD5 you specified did not match what we received."];
  if (req.method === "PUT" && md5 === undefined)
    return [400, "InvalidRequest", "Content-MD5 is missing (the tests require it on every PUT)"];

  const url = new URL(req.url, "http://x");
  const query = {};
  for (const part of url.search.replace(/^\?/, "").split("&").filter(Boolean)) {
    const i = part.indexOf("=");
    const k = decodeURIComponent(i < 0 ? part : part.slice(0, i));
    query[k] = i < 0 ? "" : decodeURIComponent(part.slice(i + 1));
  }
  const headers = {};
  for (const h of signed) headers[h] = req.headers[h] ?? "";
  const date = req.headers["x-amz-date"];
  const signingDate = new Date(Date.UTC(+date.slice(0, 4), +date.slice(4, 6) - 1, +date.slice(6, 8),
                                        +date.slice(9, 11), +date.slice(11, 13), +date.slice(13, 15)));
  const signer = new SignatureV4({ credentials: { accessKeyId, secretAccessKey: secret },
                                   region, service: "s3", sha256: Sha256, uriEscapePath: false,
                                   applyChecksum: false });
  const out = await signer.sign({ method: req.method, protocol: "http:", hostname: "x",
                                  path: url.pathname, query, headers, body },
                                { signingDate, signableHeaders: new Set(signed) });
  const want = /Signature=([0-9a-f]{64})/.exec(out.headers["authorization"])[1];
  if (want !== signature)
    return [403, "SignatureDoesNotMatch",
            "The request signature we calculated does not match the signature you provided."];
  return null;
}

http.createServer((req, res) => {
  const chunks = [];
  req.on("data", (c) => chunks.push(c));
  req.on("end", async () => {
    const body = Buffer.concat(chunks);
    const log = (status) => fs.appendFileSync(logFile, `${req.method} ${req.url} ${status}\n`);
    let bad;
    try {
      bad = await check(req, body);
    } catch (e) {
      bad = [400, "InvalidRequest", String(e.message || e).replace(/[<&]/g, " ")];
    }
    if (bad) {
      log(bad[0]);
      return s3error(res, ...bad);
    }
    const headers = { ...req.headers, "content-length": String(body.length) };
    delete headers["transfer-encoding"];
    delete headers["expect"];
    const up = http.request({ host: "127.0.0.1", port: +upstreamPort, method: req.method,
                              path: req.url, headers }, (ur) => {
      log(ur.statusCode);
      res.writeHead(ur.statusCode, ur.headers);
      ur.pipe(res);
    });
    up.on("error", () => {
      log(502);
      if (!res.headersSent) s3error(res, 502, "BadGateway", "the server behind is down");
      else res.destroy();
    });
    up.end(body);
  });
}).listen(+listenPort, listenHost || "127.0.0.1", () => console.log("listening"));
