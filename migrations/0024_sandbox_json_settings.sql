-- 0024_sandbox_json_settings: a sandbox's JSON shows the gateway's own settings of it
-- (auto_resume, sandbox_settings of 0016) wherever it is made, so kiln-node's answers from
-- sandbox_json (the create's own 201, resume, fork) show it as GET and the listing do
-- (docs/ports.md). The function the migrations before made is kept as sandbox_json_base and
-- wrapped, so whatever fields it carries stay.
ALTER FUNCTION sandbox_json(sandboxes) RENAME TO sandbox_json_base;

CREATE FUNCTION sandbox_json(s sandboxes) RETURNS jsonb LANGUAGE sql STABLE AS $$
    SELECT sandbox_json_base(s) || jsonb_build_object('auto_resume', coalesce(
        (SELECT ss.auto_resume FROM sandbox_settings ss WHERE ss.sandbox_id = s.id), false))
$$;
