-- tokenline: the PostgreSQL ledger of the split topology (broker and leases on Redis).
-- Same conventions and placeholders as stores/postgres/queries.sql. Queries named as the
-- PostgreSQL store's replace them in the split ledger: they judge a job's token by the
-- ledger's own job_fences row instead of a jobs row, which this ledger does not have.

-- name: split_schema
CREATE TABLE IF NOT EXISTS {schema}.job_fences (
    job_id      bigint PRIMARY KEY,
    token       bigint NOT NULL,
    owner       text NOT NULL,
    done_token  bigint,
    lost_token  bigint,
    updated_at  double precision NOT NULL
);
CREATE TABLE IF NOT EXISTS {schema}.redis_epochs (
    replid      text PRIMARY KEY,
    epoch       bigint NOT NULL UNIQUE,
    first_seen  double precision NOT NULL,
    prefix      text
);
-- Epoch 0 first: tokens equal Redis's counters until the first failover.
CREATE SEQUENCE IF NOT EXISTS {schema}.redis_epoch_seq MINVALUE 0 START 0;
-- This ledger's identity, one row: Redis keeps the identity of the ledger its prefix
-- serves, so that a second ledger on the same prefix is refused (split/store.py).
CREATE TABLE IF NOT EXISTS {schema}.ledger_identity (
    one         boolean PRIMARY KEY DEFAULT true CHECK (one),
    id          text NOT NULL,
    created_at  double precision NOT NULL
);

-- name: split_core_present
-- Which of the split ledger's first objects exist: none (a new ledger) or all. Some
-- but not all is damage, which CREATE … IF NOT EXISTS would hide by making them again,
-- empty: job_fences is what keeps a job done and an older token refused.
SELECT c.relname FROM pg_catalog.pg_class AS c
     JOIN pg_catalog.pg_namespace AS n ON n.oid = c.relnamespace
WHERE n.nspname = %(schema)s
  AND c.relname IN ('job_fences', 'redis_epochs', 'redis_epoch_seq');

-- name: split_schema_current
-- Whether the columns and the index added after job_fences came are all there. Asked
-- first, because ALTER TABLE … IF NOT EXISTS and CREATE INDEX IF NOT EXISTS lock the
-- table even when there is nothing to do: behind a ledger transaction that holds a
-- fence row (a paused worker's), and every fence check of the other workers behind them.
SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_attribute AS a
               JOIN pg_catalog.pg_class AS c ON c.oid = a.attrelid
               JOIN pg_catalog.pg_namespace AS n ON n.oid = c.relnamespace
               WHERE n.nspname = %(schema)s AND c.relname = 'job_fences'
                 AND a.attname = 'lost_at' AND NOT a.attisdropped)
   AND EXISTS (SELECT 1 FROM pg_catalog.pg_attribute AS a
               JOIN pg_catalog.pg_class AS c ON c.oid = a.attrelid
               JOIN pg_catalog.pg_namespace AS n ON n.oid = c.relnamespace
               WHERE n.nspname = %(schema)s AND c.relname = 'job_fences'
                 AND a.attname = 'pruned_at' AND NOT a.attisdropped)
   AND EXISTS (SELECT 1 FROM pg_catalog.pg_class AS c
               JOIN pg_catalog.pg_namespace AS n ON n.oid = c.relnamespace
               WHERE n.nspname = %(schema)s AND c.relname = 'job_fences_unsettled'
                 AND c.relkind = 'i')
   AND EXISTS (SELECT 1 FROM pg_catalog.pg_class AS c
               JOIN pg_catalog.pg_namespace AS n ON n.oid = c.relnamespace
               WHERE n.nspname = %(schema)s AND c.relname = 'ledger_identity')
   AND EXISTS (SELECT 1 FROM pg_catalog.pg_attribute AS a
               JOIN pg_catalog.pg_class AS c ON c.oid = a.attrelid
               JOIN pg_catalog.pg_namespace AS n ON n.oid = c.relnamespace
               WHERE n.nspname = %(schema)s AND c.relname = 'redis_epochs'
                 AND a.attname = 'prefix' AND NOT a.attisdropped) AS current;

-- name: split_schema_upgrade
-- When the reconciler found the job gone from Redis, not done (added after the table).
ALTER TABLE {schema}.job_fences ADD COLUMN IF NOT EXISTS lost_at double precision;
-- When retention pruned the job from Redis (added after the table): the row is kept,
-- settled, because an absent row would accept the job's next token (see fences_pruned).
ALTER TABLE {schema}.job_fences ADD COLUMN IF NOT EXISTS pruned_at double precision;
-- The rows the lost-job check reads: the settled ones (done, lost, pruned) are most.
CREATE INDEX IF NOT EXISTS job_fences_unsettled ON {schema}.job_fences (job_id)
WHERE done_token IS NULL AND lost_at IS NULL AND pruned_at IS NULL;
-- The ledger's identity (added after the tables): see split_schema.
CREATE TABLE IF NOT EXISTS {schema}.ledger_identity (
    one         boolean PRIMARY KEY DEFAULT true CHECK (one),
    id          text NOT NULL,
    created_at  double precision NOT NULL
);
-- The Redis key prefix each epoch was taken for (added after the table; NULL for the
-- epochs taken before): a prefix new to the ledger is told apart from one whose keys
-- were lost (see epoch_take).
ALTER TABLE {schema}.redis_epochs ADD COLUMN IF NOT EXISTS prefix text;

-- name: ledger_identity_take
-- The ledger's identity, made on its first open (under the migration lock).
INSERT INTO {schema}.ledger_identity (id, created_at)
VALUES (%(id)s, {schema}.now_epoch(%(now)s))
ON CONFLICT (one) DO NOTHING;

-- name: ledger_identity
SELECT id FROM {schema}.ledger_identity;

-- name: ledger_identity_present
-- Whether the identity's table is there (status reads it without the ledger's set-up).
SELECT to_regclass(format('%%I.ledger_identity', %(schema)s::text)) IS NOT NULL;

-- name: fence_check
-- First statement of a ledger write's transaction: advances the job's fence to the
-- token presented and locks the row until commit. Accepted: a token above every token
-- the ledger has seen for the job, or the same token from the same owner. Refused (no
-- row): a lower token; the same token from another owner (a promoted Redis replica
-- that handed a used number out again); any token once the job is done or pruned.
-- ON CONFLICT … DO UPDATE locks the row even when its WHERE is false and judges the
-- newest committed version: a second attempt waits for the first to commit or roll back.
-- The line marked ``-- fence`` is the owner check that the tests' sabotage removes.
INSERT INTO {schema}.job_fences AS f (job_id, token, owner, updated_at)
VALUES (%(job_id)s, %(token)s, %(owner)s, {schema}.now_epoch(NULL))
ON CONFLICT (job_id) DO UPDATE
SET token = excluded.token, owner = excluded.owner, updated_at = excluded.updated_at
WHERE f.done_token IS NULL
  AND f.token <= excluded.token
  AND (f.token < excluded.token OR f.owner = excluded.owner)  -- fence
  AND (f.lost_token IS NULL OR f.lost_token < excluded.token)
  AND f.pruned_at IS NULL
RETURNING job_id;

-- name: transaction_begin
-- First statement of a fenced transaction: fence_check, and the session settings and
-- the block's guard of stores/postgres/queries.sql's transaction_begin.
WITH guard AS (INSERT INTO {schema}.open_blocks (xact) VALUES (txid_current())),
advanced AS (
    INSERT INTO {schema}.job_fences AS f (job_id, token, owner, updated_at)
    VALUES (%(job_id)s, %(token)s, %(owner)s, {schema}.now_epoch(NULL))
    ON CONFLICT (job_id) DO UPDATE
    SET token = excluded.token, owner = excluded.owner, updated_at = excluded.updated_at
    WHERE f.done_token IS NULL
      AND f.token <= excluded.token
      AND (f.token < excluded.token OR f.owner = excluded.owner)  -- fence
      AND (f.lost_token IS NULL OR f.lost_token < excluded.token)
      AND f.pruned_at IS NULL
    RETURNING job_id
)
SELECT job_id,
       set_config('application_name', %(session)s, true),
       set_config('statement_timeout',
                  COALESCE(%(timeout_ms)s, current_setting('statement_timeout')), true),
       set_config('idle_in_transaction_session_timeout',
                  COALESCE(%(timeout_ms)s,
                           current_setting('idle_in_transaction_session_timeout')), true)
FROM advanced;

-- name: job_done
-- Last statement of a fenced transaction before COMMIT: the job's completion record,
-- only while the row still carries this attempt's token and owner (it is locked since
-- transaction_begin, so it does).
UPDATE {schema}.job_fences
SET done_token = token, updated_at = {schema}.now_epoch(NULL)
WHERE job_id = %(job_id)s AND token = %(token)s AND owner = %(owner)s
  AND done_token IS NULL
RETURNING job_id;

-- name: jobs_done
-- Which of the given jobs the ledger has completed: their effect is committed, whatever
-- the broker says.
SELECT job_id FROM {schema}.job_fences
WHERE job_id = ANY(%(job_ids)s::bigint[]) AND done_token IS NOT NULL;

-- name: effect_take
-- As the PostgreSQL store's effect_take, without the test of another job's owner: a
-- subquery would judge that owner by this statement's snapshot, which may predate the
-- owner's own commit (its job fence and its effect row commit together, here). The
-- split ledger decides that case in a later statement (effect_owner_live), under the
-- key row's lock, which ON CONFLICT … DO UPDATE takes even when its WHERE is false.
-- A rerun after a run of unknown outcome is recorded as by the PostgreSQL store's.
WITH clock AS (SELECT {schema}.now_epoch(%(now)s) AS now),
prior AS (SELECT status, error FROM {schema}.effects WHERE key = %(key)s),
taken AS (
INSERT INTO {schema}.effects AS e (key, status, job_id, token, owner, runs, created_at,
                                   updated_at)
SELECT %(key)s, 'pending', %(job_id)s, %(token)s, %(owner)s, 1, c.now, c.now FROM clock AS c
ON CONFLICT (key) DO UPDATE
SET status = 'pending', job_id = excluded.job_id, token = excluded.token,
    owner = excluded.owner, runs = e.runs + 1, result = NULL, error = NULL,
    updated_at = excluded.updated_at, completed_at = NULL
WHERE e.status <> 'completed' AND (
       (e.job_id = excluded.job_id AND (
            e.token < excluded.token OR (e.status = 'failed' AND e.token = excluded.token)))
    OR (e.job_id <> excluded.job_id AND e.status = 'failed'))
RETURNING e.*
),
rerun AS (
    INSERT INTO {schema}.duplicates (key, kind, operation, job_id, token, owner, at)
    SELECT t.key, 'repeat', %(rerun)s, t.job_id, t.token, t.owner, t.updated_at
    FROM taken AS t, prior AS p
    WHERE p.status = 'pending' OR (p.status = 'failed' AND p.error = %(abandoned)s)
)
SELECT * FROM taken;

-- name: effect_owner_live
-- Whether the owner of a pending key, another job's attempt, may still be running it:
-- the ledger's fence of its job still carries its token, the job is not done, and the
-- broker has not confirmed its lease lost (lease_lost), nor pruned its job. This ledger
-- does not see Redis's lease expiry itself: taking a key from a live owner would run
-- it twice.
SELECT 1 FROM {schema}.job_fences AS j
WHERE j.job_id = %(job_id)s AND j.token = %(token)s AND j.done_token IS NULL
  AND (j.lost_token IS NULL OR j.lost_token < j.token) AND j.pruned_at IS NULL;

-- name: effect_take_over
-- Takes a pending key from another job's attempt that effect_owner_live found gone;
-- the key row is locked by this transaction since effect_take. The run it takes over
-- has no known outcome: recorded for the audit as a rerun.
WITH taken AS (
UPDATE {schema}.effects AS e
SET status = 'pending', job_id = %(job_id)s, token = %(token)s, owner = %(owner)s,
    runs = e.runs + 1, result = NULL, error = NULL,
    updated_at = {schema}.now_epoch(%(now)s), completed_at = NULL
WHERE e.key = %(key)s AND e.status = 'pending'
RETURNING e.*
),
rerun AS (
    INSERT INTO {schema}.duplicates (key, kind, operation, job_id, token, owner, at)
    SELECT t.key, 'repeat', %(rerun)s, t.job_id, t.token, t.owner, t.updated_at
    FROM taken AS t
)
SELECT * FROM taken;

-- name: lease_lost
-- The broker says this attempt's lease is gone (expired, finished or taken over): its
-- token can never hold the job again, so it may write nothing more, and a key it left
-- pending may be taken by another job.
UPDATE {schema}.job_fences SET lost_token = %(token)s
WHERE job_id = %(job_id)s AND token = %(token)s AND owner = %(owner)s
RETURNING job_id;

-- name: duplicates_list
-- The ledger's duplicates and the fenced transactions it refused; the broker's refused
-- commits live in Redis and are merged by the split store.
SELECT key, kind, operation, job_id, token, owner, at FROM (
    SELECT key, kind, operation, job_id, token, owner, at FROM {schema}.duplicates
    UNION ALL
    SELECT 'job:' || s.job_id, 'stale', s.operation, s.job_id, s.token, s.owner, s.at
    FROM {schema}.stale_commits AS s
) AS d
WHERE %(since)s::double precision IS NULL OR at >= %(since)s::double precision
ORDER BY at DESC
LIMIT %(limit)s;

-- name: epoch_take
-- The epoch of a Redis server, by its replication id: a new id gets a number above
-- every epoch issued before (the sequence never goes back, even across a rollback).
-- No row only when another session inserted the same id concurrently: ask again.
-- With a new epoch comes the identity whose epoch it follows on the same key prefix, so
-- that the change can be told to the operator: NULL for the first epoch of a prefix new
-- to this ledger, whose keys nobody lost, and for an epoch taken before. An epoch that
-- names no prefix (taken before the ledger recorded them, or by a process of an older
-- release) is no one's previous: it could be any prefix's. The current epoch of a
-- prefix is labelled with it when it is asked for again (every open does), so that a
-- prefix's history starts with its first open by this release.
WITH taken AS (
    INSERT INTO {schema}.redis_epochs (replid, epoch, first_seen, prefix)
    VALUES (%(replid)s, nextval('{schema}.redis_epoch_seq'), {schema}.now_epoch(NULL),
            %(prefix)s)
    ON CONFLICT (replid) DO NOTHING
    RETURNING epoch
),
labelled AS (
    UPDATE {schema}.redis_epochs SET prefix = %(prefix)s
    WHERE replid = %(replid)s AND prefix IS NULL
    RETURNING epoch
)
SELECT t.epoch,
       (SELECT e.replid FROM {schema}.redis_epochs AS e
        WHERE e.epoch < t.epoch AND e.prefix = %(prefix)s
        ORDER BY e.epoch DESC LIMIT 1) AS previous
FROM taken AS t
UNION ALL
SELECT epoch, NULL FROM {schema}.redis_epochs WHERE replid = %(replid)s;

-- name: reconcile_pending_effects
-- Effect keys pending past the deadline. Whether their attempt's lease is gone is
-- Redis's to say: the split store asks it about each.
SELECT key, job_id, token, owner FROM {schema}.effects
WHERE status = 'pending' AND updated_at <= {schema}.now_epoch(%(now)s) - %(deadline)s
ORDER BY key COLLATE "C"
LIMIT %(limit)s;

-- name: fences_unsettled
-- One batch, by job id, of the jobs the ledger has seen and not completed, not yet
-- found gone from Redis, and not pruned: the split store asks Redis which of them it
-- still holds. The conditions are the partial index job_fences_unsettled's.
SELECT job_id, token, owner FROM {schema}.job_fences
WHERE done_token IS NULL AND lost_at IS NULL AND pruned_at IS NULL AND job_id > %(after)s
ORDER BY job_id
LIMIT %(limit)s;

-- name: fences_still_unsettled
-- Of the jobs fences_unsettled returned and Redis did not hold, those still unsettled
-- now: one pruned (and settled) between the two reads is not lost.
SELECT job_id FROM {schema}.job_fences
WHERE job_id = ANY(%(job_ids)s::bigint[])
  AND done_token IS NULL AND lost_at IS NULL AND pruned_at IS NULL;

-- name: fences_pruned
-- The fences of jobs retention deleted from Redis, settled rather than deleted: an
-- absent row would let the job's next ledger write in (fence_check inserts one), and
-- a stale attempt of a pruned job must stay refused. Settled rows are left by the
-- lost-job check and refuse every token.
UPDATE {schema}.job_fences
SET pruned_at = {schema}.now_epoch(%(now)s), updated_at = {schema}.now_epoch(%(now)s)
WHERE job_id = ANY(%(job_ids)s::bigint[]) AND pruned_at IS NULL;

-- name: repair_effect_fail
-- Only while still pending under the token seen (its lease is gone: Redis said so,
-- and a lost lease never comes back for its token).
UPDATE {schema}.effects
SET status = 'failed', error = %(error)s, updated_at = {schema}.now_epoch(%(now)s)
WHERE key = %(key)s AND status = 'pending' AND job_id = %(job_id)s AND token = %(token)s
RETURNING key;

-- name: job_flag_lost
-- A job gone from Redis: flagged once, only as it was seen, and its last token may
-- write nothing more here (as lease_lost).
UPDATE {schema}.job_fences
SET lost_at = {schema}.now_epoch(%(now)s), lost_token = token,
    updated_at = {schema}.now_epoch(%(now)s)
WHERE job_id = %(job_id)s AND token = %(token)s AND owner = %(owner)s
  AND done_token IS NULL AND lost_at IS NULL AND pruned_at IS NULL
RETURNING job_id;

-- name: jobs_flagged_lost
-- The jobs the reconciler found gone from Redis, newest first: for `tokenline
-- reconcile`, which reports them after they were flagged (a worker's pass, usually).
SELECT job_id, lost_at FROM {schema}.job_fences
WHERE lost_at IS NOT NULL
ORDER BY lost_at DESC, job_id
LIMIT %(limit)s;

-- name: leader_fence
-- First statement of the reconciler's ledger repairs: the maintenance lease's own fence
-- (in fences, job_id 0) advanced to the leader's term, and locked until commit. As the
-- job fence, an equal term from another owner is refused: a Redis that lost the lease
-- could hand its number out again.
INSERT INTO {schema}.fences AS f (key, issuer, token, job_id, owner, updated_at)
VALUES (%(key)s, %(issuer)s, %(token)s, 0, %(owner)s, {schema}.now_epoch(%(now)s))
ON CONFLICT (key, issuer) DO UPDATE
SET token = excluded.token, owner = excluded.owner, updated_at = excluded.updated_at
WHERE f.token < excluded.token OR (f.token = excluded.token AND f.owner = excluded.owner)
RETURNING token;
