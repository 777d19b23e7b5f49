-- tokenline: the SQLite ledger (schema version 2): unique keys, effects, fences and
-- duplicates. Every statement here runs inside BEGIN IMMEDIATE, after the job's token was
-- checked in the same transaction (see ledger.py); the write lock serialises writers of
-- every process, and the conditions below decide who may write.

-- name: schema_v2
CREATE TABLE IF NOT EXISTS tokenline_unique_keys (
    key          TEXT    PRIMARY KEY,
    job_id       INTEGER,
    held_until   REAL,
    while_active INTEGER NOT NULL DEFAULT 0,
    created_at   REAL    NOT NULL
);
CREATE TABLE IF NOT EXISTS tokenline_effects (
    key          TEXT    PRIMARY KEY,
    status       TEXT    NOT NULL CHECK (status IN ('pending', 'completed', 'failed')),
    result       TEXT,
    error        TEXT,
    job_id       INTEGER NOT NULL,
    token        INTEGER NOT NULL,
    owner        TEXT    NOT NULL,
    runs         INTEGER NOT NULL DEFAULT 1,
    created_at   REAL    NOT NULL,
    updated_at   REAL    NOT NULL,
    completed_at REAL
);
CREATE INDEX IF NOT EXISTS tokenline_effects_job ON tokenline_effects (job_id);
CREATE TABLE IF NOT EXISTS tokenline_fences (
    key        TEXT    NOT NULL,
    issuer     TEXT    NOT NULL,
    token      INTEGER NOT NULL,
    job_id     INTEGER NOT NULL,
    owner      TEXT    NOT NULL,
    updated_at REAL    NOT NULL,
    PRIMARY KEY (key, issuer)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS tokenline_duplicates (
    id        INTEGER PRIMARY KEY,
    key       TEXT    NOT NULL,
    kind      TEXT    NOT NULL CHECK (kind IN ('repeat', 'stale')),
    operation TEXT    NOT NULL,
    job_id    INTEGER,
    token     INTEGER NOT NULL,
    owner     TEXT    NOT NULL,
    at        REAL    NOT NULL
);
CREATE INDEX IF NOT EXISTS tokenline_duplicates_at ON tokenline_duplicates (at);

-- name: unique_claim
-- Takes the key (job_id filled in once the job row exists) if it is new or its holder
-- let go: past held_until, or a while-active holder that has finished. Returns no row
-- while the key is held.
INSERT INTO tokenline_unique_keys (key, job_id, held_until, while_active, created_at)
VALUES (:key, NULL, :now + :unique_for, :while_active, :now)
ON CONFLICT (key) DO UPDATE
SET job_id = NULL, held_until = excluded.held_until,
    while_active = excluded.while_active, created_at = excluded.created_at
WHERE (tokenline_unique_keys.held_until IS NOT NULL
       AND tokenline_unique_keys.held_until <= excluded.created_at)
   OR (tokenline_unique_keys.while_active AND EXISTS (
           SELECT 1 FROM tokenline_jobs AS j
           WHERE j.id = tokenline_unique_keys.job_id
             AND j.state IN ('succeeded', 'dead', 'cancelled')))
RETURNING key;

-- name: unique_fill
UPDATE tokenline_unique_keys SET job_id = :job_id WHERE key = :key;

-- name: unique_holder
SELECT job_id FROM tokenline_unique_keys WHERE key = :key;

-- name: effect_take
-- Takes the key for (job_id, token) when may_take() in stores/memory/ledger.py allows it;
-- the owner of a pending key is live while its job runs under that token, unexpired.
INSERT INTO tokenline_effects (key, status, job_id, token, owner, runs, created_at, updated_at)
VALUES (:key, 'pending', :job_id, :token, :owner, 1, :now, :now)
ON CONFLICT (key) DO UPDATE
SET status = 'pending', job_id = excluded.job_id, token = excluded.token,
    owner = excluded.owner, runs = tokenline_effects.runs + 1, result = NULL, error = NULL,
    updated_at = excluded.updated_at, completed_at = NULL
WHERE tokenline_effects.status <> 'completed' AND (
       (tokenline_effects.job_id = excluded.job_id AND (
            tokenline_effects.token < excluded.token
         OR (tokenline_effects.status = 'failed'
             AND tokenline_effects.token = excluded.token)))
    OR (tokenline_effects.job_id <> excluded.job_id AND (
            tokenline_effects.status = 'failed'
         OR NOT EXISTS (
                SELECT 1 FROM tokenline_jobs AS j
                JOIN coord.job_leases AS l ON l.job_id = j.id AND l.token = j.lease_token
                WHERE j.id = tokenline_effects.job_id
                  AND j.state = 'running'
                  AND j.lease_token = tokenline_effects.token
                  AND l.expires_at > excluded.updated_at))))
RETURNING *;

-- name: effect_get
SELECT * FROM tokenline_effects WHERE key = :key;

-- name: effect_finish
UPDATE tokenline_effects
SET status = :status, result = :result, error = :error, updated_at = :now,
    completed_at = CASE WHEN :status = 'completed' THEN :now END
WHERE key = :key AND job_id = :job_id AND token = :token AND owner = :owner
  AND status = 'pending';

-- name: effects_list
SELECT * FROM tokenline_effects
WHERE (:job_id IS NULL OR job_id = :job_id) AND (:key IS NULL OR key = :key)
ORDER BY updated_at DESC LIMIT :limit;

-- name: fence_advance
-- Per (key, issuer) the highest token that wrote: a lower one matches nothing, and an
-- equal one passes only from the same holder writing again (the same job, on the same
-- worker), as on PostgreSQL.
INSERT INTO tokenline_fences (key, issuer, token, job_id, owner, updated_at)
VALUES (:key, :issuer, :token, :job_id, :owner, :now)
ON CONFLICT (key, issuer) DO UPDATE
SET token = excluded.token, job_id = excluded.job_id, owner = excluded.owner,
    updated_at = excluded.updated_at
WHERE tokenline_fences.token <= excluded.token
  AND (tokenline_fences.token < excluded.token
       OR (tokenline_fences.job_id, tokenline_fences.owner) IS (excluded.job_id, excluded.owner))  -- fence
RETURNING token;

-- name: duplicate_insert
INSERT INTO tokenline_duplicates (key, kind, operation, job_id, token, owner, at)
VALUES (:key, :kind, :operation, :job_id, :token, :owner, :now);

-- name: duplicates_list
SELECT key, kind, operation, job_id, token, owner, at FROM (
    SELECT key, kind, operation, job_id, token, owner, at FROM tokenline_duplicates
    UNION ALL
    SELECT COALESCE(j.idempotency_key, 'job:' || s.job_id), 'stale', s.operation,
           s.job_id, s.token, s.owner, s.at
    FROM tokenline_stale_commits AS s LEFT JOIN tokenline_jobs AS j ON j.id = s.job_id
)
WHERE :since IS NULL OR at >= :since
ORDER BY at DESC LIMIT :limit;
