// verify.js - the independent client of the storage tests: @aws-sdk/client-s3 reads what Kiln
// wrote (secret: $S3_SECRET_ACCESS_KEY). Prints one JSON line.
//
//   node verify.js ENDPOINT BUCKET get KEY OUTFILE   -> {"size": N, "etag": "..."}
//   node verify.js ENDPOINT BUCKET list PREFIX       -> {"keys": [{"key", "size"}]}
//   node verify.js ENDPOINT BUCKET put KEY TEXT      -> {}
"use strict";
const fs = require("fs");
const { S3Client, GetObjectCommand, ListObjectsV2Command, PutObjectCommand } =
  require("@aws-sdk/client-s3");

async function main() {
  const [endpoint, bucket, op, ...args] = process.argv.slice(2);
  const s3 = new S3Client({
    endpoint, region: "us-east-1", forcePathStyle: true,
    credentials: { accessKeyId: "S3RVER",
                   secretAccessKey: process.env.S3_SECRET_ACCESS_KEY || "S3RVER" },
    requestChecksumCalculation: "WHEN_REQUIRED", responseChecksumValidation: "WHEN_REQUIRED",
  });
  if (op === "get") {
    const r = await s3.send(new GetObjectCommand({ Bucket: bucket, Key: args[0] }));
    const bytes = Buffer.from(await r.Body.transformToByteArray());
    fs.writeFileSync(args[1], bytes);
    return { size: bytes.length, etag: r.ETag };
  }
  if (op === "list") {
    const r = await s3.send(new ListObjectsV2Command({ Bucket: bucket, Prefix: args[0] }));
    return { keys: (r.Contents || []).map((c) => ({ key: c.Key, size: c.Size })) };
  }
  if (op === "put") {
    const body = Buffer.from(args[1]);
    const md5 = require("crypto").createHash("md5").update(body).digest("base64");
    await s3.send(new PutObjectCommand({ Bucket: bucket, Key: args[0], Body: body, ContentMD5: md5 }));
    return {};
  }
  throw new Error("unknown op " + op);
}

main().then((r) => console.log(JSON.stringify(r)),
            (e) => { console.log(JSON.stringify({ error: e.name, message: e.message })); process.exit(1); });
