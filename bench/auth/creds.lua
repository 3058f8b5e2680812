-- creds.lua - wrk script for bench/auth/keys.sh: each request carries the next credential of a
-- file (one a line), so a run cycles through many distinct API keys or tokens; with "post" it is
-- POST /v1/tokens with a fresh Idempotency-Key per request (unique across runs by NONCE).
-- Usage: wrk ... -s creds.lua URL -- CRED_FILE [get|post] [NONCE]

local counter = 0

function setup(thread)
  counter = counter + 1
  thread:set("tid", counter)
end

local creds, n, i, post, nonce, seq = {}, 0, 0, false, "0", 0

function init(args)
  for line in io.lines(args[1]) do
    n = n + 1
    creds[n] = line
  end
  if n == 0 then
    error("no credentials in " .. args[1])
  end
  post = args[2] == "post"
  nonce = args[3] or "0"
  -- threads start at different places in the list
  i = ((tid or 1) * 7919) % n
end

function request()
  i = i % n + 1
  local h = { ["Authorization"] = "Bearer " .. creds[i] }
  if post then
    seq = seq + 1
    h["Content-Type"] = "application/json"
    h["Idempotency-Key"] = string.format("bench-%s-%d-%d", nonce, tid or 1, seq)
    return wrk.format("POST", nil, h, '{"ttl_s":60}')
  end
  return wrk.format("GET", nil, h)
end
