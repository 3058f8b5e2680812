-- 0005_rfc3339: rfc3339() as STABLE, so Postgres inlines it.
--
-- 0001 declared it IMMUTABLE, but its body calls to_char(timestamp, text), which is STABLE.
-- Postgres only inlines a SQL function whose body is no more volatile than the function says it
-- is, so every call went through the SQL function executor instead of becoming the to_char
-- expression itself; GET /v1/api-keys makes four calls a row, which halved that query's rate.
-- STABLE is also the truth: nothing that depends on rfc3339() needs it to be IMMUTABLE (no index
-- or generated column uses it). Same body, same NULL-in NULL-out (STRICT keeps inlining here
-- because the body is strict in its one argument, used once).
CREATE OR REPLACE FUNCTION rfc3339(t timestamptz) RETURNS text
    LANGUAGE sql STABLE STRICT PARALLEL SAFE AS $$
    SELECT to_char(t AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS"Z"')
$$;
