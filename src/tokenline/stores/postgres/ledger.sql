-- tokenline: the PostgreSQL ledger (migration 0002): effects, fences, fenced renewal of
-- resource leases and the duplicate audit. Conventions as in queries.sql.
--
-- Ledger writes that need the job's token run in one transaction whose first statement
-- is fence_check (queries.sql), which locks the job row until commit. ON CONFLICT … DO
-- UPDATE locks the conflicting key row even when its WHERE is false, and judges that row
-- by its newest committed version: two attempts racing for one key are serialised there.

-- name: effect_take
-- Takes the key for (job_id, token) when may_take() in stores/memory/ledger.py allows it,
-- and only while the attempt holds the job: its row is checked and locked first, as by
-- fence_check, to the end of the statement's transaction (alone, in autocommit: a whole
-- effect_begin in one round trip; no row, and the caller's transaction finds out why).
-- The owner of a pending key is live while its job runs under that token, unexpired; our
-- snapshot of another job can only be older than the truth, and an older view of a lease
-- is never less live (an expired lease is never renewed back), so a live owner is never
-- taken over. A take that starts the callee again after a run of unknown outcome (the
-- key pending, or given up by the reconciler) is recorded for the audit in the same
-- statement (reruns() in stores/_repairs.py): the key's row as this statement's snapshot
-- saw it tells how its last run ended.
WITH fenced AS MATERIALIZED (
    SELECT id FROM {schema}.jobs
    WHERE id = %(job_id)s
      AND lease_token = %(token)s AND lease_owner = %(owner)s  -- fence
      AND state = 'running'
    FOR NO KEY UPDATE
),
clock AS (SELECT {schema}.now_epoch(%(now)s) AS now),
prior AS (SELECT status, error FROM {schema}.effects WHERE key = %(key)s),
taken AS (
INSERT INTO {schema}.effects AS e (key, status, job_id, token, owner, runs, created_at,
                                   updated_at)
SELECT %(key)s, 'pending', f.id, %(token)s, %(owner)s, 1, c.now, c.now
FROM clock AS c, fenced AS f
ON CONFLICT (key) DO UPDATE
SET status = 'pending', job_id = excluded.job_id, token = excluded.token,
    owner = excluded.owner, runs = e.runs + 1, result = NULL, error = NULL,
    updated_at = excluded.updated_at, completed_at = NULL
WHERE e.status <> 'completed' AND (
       (e.job_id = excluded.job_id AND (
            e.token < excluded.token OR (e.status = 'failed' AND e.token = excluded.token)))
    OR (e.job_id <> excluded.job_id AND (
            e.status = 'failed'
         OR NOT EXISTS (
                SELECT 1 FROM {schema}.jobs AS j
                WHERE j.id = e.job_id
                  AND j.state = 'running'
                  AND j.lease_token = e.token
                  AND j.lease_expires_at > excluded.updated_at))))
RETURNING e.*
),
rerun AS (
    INSERT INTO {schema}.duplicates (key, kind, operation, job_id, token, owner, at)
    SELECT t.key, 'repeat', %(rerun)s, t.job_id, t.token, t.owner, t.updated_at
    FROM taken AS t, prior AS p
    WHERE p.status = 'pending' OR (p.status = 'failed' AND p.error = %(abandoned)s)
)
SELECT * FROM taken;

-- name: effect_get
SELECT * FROM {schema}.effects WHERE key = %(key)s;

-- name: effect_finish
-- The outcome of a pending effect, fenced by the key's own (job, token): refused rows are
-- recorded as stale duplicates by the same statement.
WITH clock AS (SELECT {schema}.now_epoch(%(now)s) AS now),
done AS (
    UPDATE {schema}.effects AS e
    SET status = %(status)s, result = %(result)s, error = %(error)s, updated_at = c.now,
        completed_at = CASE WHEN %(status)s = 'completed' THEN c.now END
    FROM clock AS c
    WHERE e.key = %(key)s AND e.job_id = %(job_id)s AND e.token = %(token)s
      AND e.owner = %(owner)s AND e.status = 'pending'
    RETURNING e.key
),
stale AS (
    INSERT INTO {schema}.duplicates (key, kind, operation, job_id, token, owner, at)
    SELECT %(key)s, 'stale', %(operation)s, %(job_id)s, %(token)s, %(owner)s, c.now
    FROM clock AS c
    WHERE NOT EXISTS (SELECT 1 FROM done)
)
SELECT count(*) FROM done;

-- name: effects_list
SELECT * FROM {schema}.effects
WHERE (%(job_id)s::bigint IS NULL OR job_id = %(job_id)s::bigint)
  AND (%(key)s::text IS NULL OR key = %(key)s::text)
ORDER BY updated_at DESC
LIMIT %(limit)s;

-- name: lease_held
-- KEY SHARE: a fenced transaction must not hold up the control plane's renewal of the
-- lease it checked. Safety does not need more: a newer holder's token is higher, and the
-- fence row (locked by fence_advance until commit) refuses whichever comes second with
-- a lower token.
SELECT 1 FROM {schema}.leases
WHERE resource = %(resource)s AND owner = %(owner)s AND token = %(token)s
  AND expires_at > {schema}.now_epoch(%(now)s)
FOR KEY SHARE;

-- name: fence_advance
-- Per (key, issuer) the highest token that wrote: a lower one matches nothing, and an
-- equal one passes only from the same holder writing again (the same job, on the same
-- worker). A resource lease's token issued twice (its Redis key lost: evicted, deleted)
-- is refused from the second holder, even one on the same worker.
INSERT INTO {schema}.fences AS f (key, issuer, token, job_id, owner, updated_at)
VALUES (%(key)s, %(issuer)s, %(token)s, %(job_id)s, %(owner)s, {schema}.now_epoch(%(now)s))
ON CONFLICT (key, issuer) DO UPDATE
SET token = excluded.token, job_id = excluded.job_id, owner = excluded.owner,
    updated_at = excluded.updated_at
WHERE f.token <= excluded.token
  AND (f.token < excluded.token OR (f.job_id, f.owner) IS NOT DISTINCT FROM (excluded.job_id, excluded.owner))  -- fence
RETURNING token;

-- name: duplicate_insert
INSERT INTO {schema}.duplicates (key, kind, operation, job_id, token, owner, at)
VALUES (%(key)s, %(kind)s, %(operation)s, %(job_id)s, %(token)s, %(owner)s,
        {schema}.now_epoch(%(now)s));

-- name: resource_lease_renew
-- Fenced by owner and token, never by owner alone; a refusal while another token holds
-- the lease is recorded as a stale duplicate by the same statement.
WITH clock AS (SELECT {schema}.now_epoch(%(now)s) AS now),
renewed AS (
    UPDATE {schema}.leases AS l
    SET expires_at = c.now + %(ttl)s
    FROM clock AS c
    WHERE l.resource = %(resource)s AND l.owner = %(owner)s AND l.token = %(token)s
      AND l.expires_at > c.now
    RETURNING l.resource, l.owner, l.token, l.expires_at
),
stale AS (
    INSERT INTO {schema}.duplicates (key, kind, operation, job_id, token, owner, at)
    SELECT %(resource)s, 'stale', 'resource_lease_renew', NULL, %(token)s, %(owner)s, c.now
    FROM clock AS c
    WHERE NOT EXISTS (SELECT 1 FROM renewed)
      AND EXISTS (SELECT 1 FROM {schema}.leases AS l
                  WHERE l.resource = %(resource)s AND l.token <> %(token)s)
)
SELECT resource, owner, token, expires_at FROM renewed;

-- name: duplicates_list
SELECT key, kind, operation, job_id, token, owner, at FROM (
    SELECT key, kind, operation, job_id, token, owner, at FROM {schema}.duplicates
    UNION ALL
    SELECT COALESCE(j.idempotency_key, 'job:' || s.job_id), 'stale', s.operation,
           s.job_id, s.token, s.owner, s.at
    FROM {schema}.stale_commits AS s LEFT JOIN {schema}.jobs AS j ON j.id = s.job_id
) AS d
WHERE %(since)s::double precision IS NULL OR at >= %(since)s::double precision
ORDER BY at DESC
LIMIT %(limit)s;
