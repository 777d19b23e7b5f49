-- tokenline: SQLite queries. Every finalising write is conditional on the job's
-- lease token inside the statement itself; see stores/base.py for the contract.
-- Lines ending in "-- fence" hold a token check (the tests prove, by removing them from
-- a copy, that the drill notices).
-- Parameters are named (:name); lists arrive as JSON text and are read with json_each.

-- name: schema
CREATE TABLE IF NOT EXISTS tokenline_jobs (
    id               INTEGER PRIMARY KEY AUTOINCREMENT,
    queue            TEXT    NOT NULL,
    task             TEXT    NOT NULL,
    args             TEXT    NOT NULL,
    idempotency_key  TEXT,
    priority         INTEGER NOT NULL DEFAULT 0,
    run_at           REAL    NOT NULL,
    attempt          INTEGER NOT NULL DEFAULT 0,
    max_attempts     INTEGER NOT NULL,
    state            TEXT    NOT NULL CHECK (state IN
                        ('scheduled', 'queued', 'running', 'succeeded', 'dead', 'cancelled')),
    lease_owner      TEXT,
    lease_token      INTEGER NOT NULL DEFAULT 0,
    lease_expires_at REAL,
    last_error       TEXT,
    error_class      TEXT,
    created_at       REAL    NOT NULL,
    updated_at       REAL    NOT NULL,
    finished_at      REAL,
    timeout          REAL
);
CREATE INDEX IF NOT EXISTS tokenline_jobs_ready
    ON tokenline_jobs (queue, priority DESC, run_at, id)
    WHERE state IN ('queued', 'scheduled');
CREATE INDEX IF NOT EXISTS tokenline_jobs_expiry
    ON tokenline_jobs (lease_expires_at) WHERE state = 'running';
CREATE INDEX IF NOT EXISTS tokenline_jobs_queue_state ON tokenline_jobs (queue, state);
-- The store itself refuses a backwards move, whatever SQL a bug or a stale worker sends.
CREATE TRIGGER IF NOT EXISTS tokenline_jobs_monotonic
BEFORE UPDATE OF state ON tokenline_jobs
WHEN NEW.state <> OLD.state AND NOT (
       (OLD.state = 'scheduled' AND NEW.state IN ('queued', 'running', 'cancelled'))
    OR (OLD.state = 'queued'    AND NEW.state IN ('running', 'cancelled'))
    OR (OLD.state = 'running'   AND NEW.state IN ('succeeded', 'dead', 'queued', 'scheduled'))
    OR (OLD.state = 'dead'      AND NEW.state IN ('queued', 'cancelled'))
)
BEGIN
    SELECT RAISE(ABORT, 'tokenline: illegal job state transition');
END;
CREATE TABLE IF NOT EXISTS tokenline_attempts (
    job_id      INTEGER NOT NULL,
    token       INTEGER NOT NULL,
    attempt     INTEGER NOT NULL,
    owner       TEXT    NOT NULL,
    started_at  REAL    NOT NULL,
    finished_at REAL,
    outcome     TEXT,
    error       TEXT,
    error_class TEXT,
    PRIMARY KEY (job_id, token)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS tokenline_stale_commits (
    id        INTEGER PRIMARY KEY,
    job_id    INTEGER NOT NULL,
    token     INTEGER NOT NULL,
    owner     TEXT    NOT NULL,
    operation TEXT    NOT NULL,
    at        REAL    NOT NULL
);
CREATE TABLE IF NOT EXISTS tokenline_paused_queues (
    queue     TEXT PRIMARY KEY,
    paused_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS tokenline_workers (
    id           TEXT PRIMARY KEY,
    host         TEXT    NOT NULL,
    pid          INTEGER NOT NULL,
    queues       TEXT    NOT NULL,
    concurrency  INTEGER NOT NULL,
    state        TEXT    NOT NULL,
    token        INTEGER NOT NULL,
    started_at   REAL    NOT NULL,
    heartbeat_at REAL    NOT NULL,
    expires_at   REAL    NOT NULL,
    in_flight    INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS tokenline_leases (
    resource   TEXT PRIMARY KEY,
    owner      TEXT    NOT NULL,
    token      INTEGER NOT NULL,
    expires_at REAL    NOT NULL
);

-- name: enqueue
INSERT INTO tokenline_jobs (queue, task, args, idempotency_key, priority, run_at,
                            max_attempts, state, created_at, updated_at, timeout,
                            max_lease_expiries)
VALUES (:queue, :task, :args, :idempotency_key, :priority, :run_at,
        :max_attempts, :state, :now, :now, :timeout, :max_lease_expiries);

-- name: last_job_id
SELECT seq FROM sqlite_sequence WHERE name = 'tokenline_jobs';

-- name: claim_candidates
-- One queue at a time, so the scan follows tokenline_jobs_ready in order and stops at
-- the limit (an IN over several queues would sort the whole backlog). The caller merges
-- the queues' candidates and claims the best, in the same write transaction. INDEXED
-- BY: without statistics, the planner would rather take tokenline_jobs_ready_age for
-- its range on run_at, and sort every runnable job of the queue.
-- The inner scan reads the index in order, runnable or not, and stops after :window
-- entries; the outer keeps the runnable ones, in that order, up to :limit. A filter on
-- run_at in the scan itself would step over every job not yet runnable that sits above
-- the runnable ones (a backlog of delayed or backed-off jobs of a higher priority),
-- however many. Past the window, the caller reads a priority at a time (_claim.py).
SELECT id, priority, run_at, lease_token FROM (
    SELECT id, priority, run_at, lease_token FROM tokenline_jobs INDEXED BY tokenline_jobs_ready
    WHERE queue = :queue
      AND state IN ('queued', 'scheduled')
      AND NOT EXISTS (SELECT 1 FROM tokenline_paused_queues WHERE queue = :queue)
    ORDER BY priority DESC, run_at, id
    LIMIT :window
)
WHERE run_at <= :now
LIMIT :limit;

-- name: claim_window_end
-- The last entry of claim_candidates' window, or none when the queue holds fewer: where
-- a claim that found too few runnable jobs in the window goes on from.
SELECT priority, run_at, id FROM tokenline_jobs INDEXED BY tokenline_jobs_ready
WHERE queue = :queue
  AND state IN ('queued', 'scheduled')
  AND NOT EXISTS (SELECT 1 FROM tokenline_paused_queues WHERE queue = :queue)
ORDER BY priority DESC, run_at, id
LIMIT 1 OFFSET :window - 1;

-- name: claim_oldest
-- The queue's oldest ready job (one step into tokenline_jobs_ready_age): no runnable
-- job of the queue has waited longer, so none has aged by more priority points.
SELECT run_at FROM tokenline_jobs
WHERE queue = :queue AND state IN ('queued', 'scheduled')
ORDER BY run_at
LIMIT 1;

-- name: claim_next_level
-- The next lower priority present in the queue, runnable or not, down to :lowest: one
-- seek in tokenline_jobs_ready per priority present, never a visit of each number
-- between, nor of each job not yet runnable (claim_level then reads the runnable ones).
SELECT priority FROM tokenline_jobs INDEXED BY tokenline_jobs_ready
WHERE queue = :queue
  AND state IN ('queued', 'scheduled')
  AND priority < :below
  AND priority >= :lowest
ORDER BY priority DESC
LIMIT 1;

-- name: claim_level
-- The oldest runnable jobs of one priority after (:after_run_at, :after_id), in order:
-- within a priority, the oldest has aged most. One index range, which ends at the first
-- job not yet runnable.
SELECT id, priority, run_at, lease_token FROM tokenline_jobs INDEXED BY tokenline_jobs_ready
WHERE queue = :queue
  AND priority = :priority
  AND state IN ('queued', 'scheduled')
  AND (run_at, id) > (:after_run_at, :after_id)
  AND run_at <= :now
ORDER BY run_at, id
LIMIT :limit;

-- name: claim
UPDATE tokenline_jobs
SET state = 'running',
    attempt = attempt + 1,
    lease_owner = :owner,
    lease_token = lease_token + 1,
    lease_expires_at = :now + :ttl,
    updated_at = :now
WHERE id IN (SELECT value FROM json_each(:ids))
  AND state IN ('queued', 'scheduled')
RETURNING *;

-- name: attempt_start
INSERT INTO tokenline_attempts (job_id, token, attempt, owner, started_at)
VALUES (:job_id, :token, :attempt, :owner, :now);

-- name: finish
UPDATE tokenline_jobs
SET state = :state,
    run_at = COALESCE(:run_at, run_at),
    attempt = attempt - :refund,
    lease_owner = NULL,
    lease_expires_at = NULL,
    last_error = :error,
    error_class = :error_class,
    finished_at = :finished_at,
    updated_at = :now
WHERE id = :job_id AND state = 'running'
  AND lease_token = :token AND lease_owner = :owner  -- fence

-- name: attempt_finish
UPDATE tokenline_attempts
SET finished_at = :now, outcome = :outcome, error = :error, error_class = :error_class
WHERE job_id = :job_id AND token = :token AND finished_at IS NULL;

-- name: stale_insert
INSERT INTO tokenline_stale_commits (job_id, token, owner, operation, at)
VALUES (:job_id, :token, :owner, :operation, :now);

-- name: fence_check
-- Takes the write lock (inside BEGIN IMMEDIATE) and proves the token is current.
UPDATE tokenline_jobs SET updated_at = :now
WHERE id = :job_id AND state = 'running'
  AND lease_token = :token AND lease_owner = :owner  -- fence

-- name: rescue_candidates
-- Running jobs without a live lease in the coordination file (attached read-only: its
-- snapshot is taken after this transaction took the main file's write lock, so every
-- committed claim's lease row is in it). An expired lease cannot come back to life, so
-- the snapshot never makes a live lease look expired.
SELECT j.id, j.lease_token, j.lease_owner, j.attempt, j.max_attempts, j.lease_expiries,
       j.max_lease_expiries
FROM tokenline_jobs AS j
WHERE j.state = 'running'
  AND NOT EXISTS (
      SELECT 1 FROM coord.job_leases AS l
      WHERE l.job_id = j.id AND l.token = j.lease_token AND l.expires_at > :now)
ORDER BY j.lease_expires_at, j.id
LIMIT :limit;

-- name: rescue_attempt
UPDATE tokenline_attempts
SET finished_at = :now, outcome = 'lease_expired', error = :error,
    error_class = 'coordination'
WHERE job_id = :job_id AND token = :token AND finished_at IS NULL;

-- name: rescue
-- Under the same write lock as rescue_candidates; the token is checked again anyway.
UPDATE tokenline_jobs
SET state = :state,
    finished_at = CASE WHEN :final THEN :now END,
    attempt = attempt - :refund,
    lease_expiries = lease_expiries + 1,
    lease_token = lease_token + 1,
    lease_owner = NULL,
    lease_expires_at = NULL,
    run_at = COALESCE(:run_at, run_at),
    last_error = :error,
    error_class = 'coordination',
    updated_at = :now
WHERE id = :job_id AND lease_token = :token AND state = 'running';

-- name: pause
INSERT INTO tokenline_paused_queues (queue, paused_at) VALUES (:queue, :now)
ON CONFLICT (queue) DO NOTHING;

-- name: resume
DELETE FROM tokenline_paused_queues WHERE queue = :queue;

-- name: stats_counts
SELECT queue, state, count(*) AS n FROM tokenline_jobs GROUP BY queue, state;

-- name: stats_oldest
SELECT queue, min(run_at) AS oldest FROM tokenline_jobs
WHERE state IN ('queued', 'scheduled') AND run_at <= :now
GROUP BY queue;

-- name: paused_list
SELECT queue FROM tokenline_paused_queues;

-- name: jobs_depth
-- A scheduled job whose run_at has come is runnable: it counts as queued.
SELECT queue, task,
       CASE WHEN state = 'running' THEN 'running'
            WHEN run_at <= :now THEN 'queued'
            ELSE 'scheduled' END AS depth_state,
       count(*) AS n
FROM tokenline_jobs
WHERE state IN ('queued', 'scheduled', 'running')
GROUP BY queue, task, depth_state
ORDER BY queue, task, depth_state;

-- name: job_get
-- A running job's lease expiry lives in the coordination file (renewals go there).
SELECT j.*, l.expires_at AS live_expires_at
FROM tokenline_jobs AS j
LEFT JOIN coord.job_leases AS l
       ON l.job_id = j.id AND l.token = j.lease_token AND j.state = 'running'
WHERE j.id = :job_id;

-- name: jobs_list
-- Every column of a job but args, which a listing that does not show it whole asks cut
-- (:args_limit characters; NULL: whole): a payload may be megabytes.
SELECT j.id, j.queue, j.task,
       CASE WHEN :args_limit IS NULL THEN j.args ELSE substr(j.args, 1, :args_limit) END
           AS args,
       j.idempotency_key, j.priority, j.run_at, j.attempt, j.max_attempts, j.state,
       j.lease_owner, j.lease_token, j.lease_expires_at, j.last_error, j.error_class,
       j.created_at, j.updated_at, j.finished_at, j.timeout, j.lease_expiries,
       j.max_lease_expiries, l.expires_at AS live_expires_at
FROM tokenline_jobs AS j
LEFT JOIN coord.job_leases AS l
       ON l.job_id = j.id AND l.token = j.lease_token AND j.state = 'running'
WHERE (:state IS NULL OR j.state = :state) AND (:queue IS NULL OR j.queue = :queue)
ORDER BY j.id DESC LIMIT :limit;

-- name: attempts_list
SELECT * FROM tokenline_attempts WHERE job_id = :job_id ORDER BY token;

-- name: retry_dead
-- A fresh budget: attempt 0 of the job's own max_attempts; the attempts table keeps the
-- earlier ones, and the token is left for the next claim to bump.
UPDATE tokenline_jobs
SET state = 'queued', attempt = 0, lease_expiries = 0, run_at = :now,
    finished_at = NULL, updated_at = :now
WHERE id IN (SELECT value FROM json_each(:ids)) AND state = 'dead';

-- name: cancel
UPDATE tokenline_jobs
SET state = 'cancelled', last_error = :reason, error_class = NULL, finished_at = :now,
    updated_at = :now
WHERE id IN (SELECT value FROM json_each(:ids))
  AND state IN ('queued', 'scheduled', 'dead');

-- name: stale_count
SELECT count(*) FROM tokenline_stale_commits;

-- name: stale_list
SELECT job_id, token, owner, operation, at FROM tokenline_stale_commits
ORDER BY id DESC LIMIT :limit;

-- name: lease_token_get
SELECT token FROM tokenline_lease_tokens WHERE resource = :resource;

-- name: lease_token_raise
INSERT INTO tokenline_lease_tokens (resource, token) VALUES (:resource, :token)
ON CONFLICT (resource) DO UPDATE
SET token = max(tokenline_lease_tokens.token, excluded.token);

-- name: schema_v3
-- Leases move to the coordination file (coord.sql). The main file keeps, per resource,
-- the highest token ever issued, so that a token never repeats, even if the
-- coordination file is lost.
CREATE TABLE IF NOT EXISTS tokenline_lease_tokens (
    resource TEXT    PRIMARY KEY,
    token    INTEGER NOT NULL
);
INSERT INTO tokenline_lease_tokens (resource, token)
SELECT resource, token FROM tokenline_leases WHERE true
ON CONFLICT (resource) DO UPDATE
SET token = max(tokenline_lease_tokens.token, excluded.token);
DROP TABLE IF EXISTS tokenline_leases;
DROP TABLE IF EXISTS tokenline_workers;

-- name: schema_v4
-- A lost lease counts toward its own limit, not toward the job's attempts.
ALTER TABLE tokenline_jobs ADD COLUMN lease_expiries INTEGER NOT NULL DEFAULT 0;
ALTER TABLE tokenline_jobs ADD COLUMN max_lease_expiries INTEGER NOT NULL DEFAULT 3;

-- name: schema_v5
-- Priority aging: the age of a queue's oldest ready job, read in one step, bounds how
-- far aging can lift any of its jobs (see the claim).
CREATE INDEX IF NOT EXISTS tokenline_jobs_ready_age
    ON tokenline_jobs (queue, run_at)
    WHERE state IN ('queued', 'scheduled');

-- name: schema_v6
-- Retention: finished jobs are found per state and age in one index range. Periodic
-- jobs: each schedule's high-water mark, the last instant it handled (scheduler.py).
CREATE INDEX IF NOT EXISTS tokenline_jobs_finished
    ON tokenline_jobs (state, finished_at)
    WHERE state IN ('succeeded', 'dead', 'cancelled');
CREATE TABLE IF NOT EXISTS tokenline_schedules (
    name       TEXT PRIMARY KEY,
    mark       REAL NOT NULL,
    updated_at REAL NOT NULL
);

-- name: schema_v7
-- SQLite keeps whatever a statement writes into a column ('abc' in priority) where
-- PostgreSQL's types refuse it. One such row, written by hand, stopped every worker of
-- its queue (the claim ranks jobs by priority and run_at in Python) or sat queued for
-- good; a queue name that is not text stopped every listing of the queues, and an
-- infinite run_at every claim. The store refuses a priority, run_at or queue of the
-- wrong type instead, whatever SQL writes it. (A malformed payload, unlike these, is
-- dead-lettered with the reason.)
CREATE TRIGGER IF NOT EXISTS tokenline_jobs_types_insert
BEFORE INSERT ON tokenline_jobs
WHEN
    typeof(NEW.priority) <> 'integer' OR typeof(NEW.run_at) NOT IN ('real', 'integer')
    OR abs(NEW.run_at) >= 9e999 OR typeof(NEW.queue) <> 'text'
BEGIN
    SELECT RAISE(ABORT, 'tokenline: a job''s priority must be an integer, its run_at a finite number and its queue text');
END;
CREATE TRIGGER IF NOT EXISTS tokenline_jobs_types_update
BEFORE UPDATE OF priority, run_at, queue ON tokenline_jobs
WHEN
    typeof(NEW.priority) <> 'integer' OR typeof(NEW.run_at) NOT IN ('real', 'integer')
    OR abs(NEW.run_at) >= 9e999 OR typeof(NEW.queue) <> 'text'
BEGIN
    SELECT RAISE(ABORT, 'tokenline: a job''s priority must be an integer, its run_at a finite number and its queue text');
END;

-- name: leader_holds
-- Run first in every maintenance write transaction (BEGIN IMMEDIATE on the main file).
-- The coordination file says whether the lease is held and unexpired; the main file's
-- highest issued token, read under its write lock, says no newer leader exists: a
-- takeover raises it under that same lock, so it lands wholly before or after us.
SELECT 1 FROM coord.resource_leases AS l
WHERE l.resource = :resource AND l.owner = :owner AND l.token = :token
  AND l.expires_at > :now
  AND NOT EXISTS (SELECT 1 FROM tokenline_lease_tokens AS t
                  WHERE t.resource = :resource AND t.token > :token);

-- name: prune_jobs_pick
-- The first IN repeats the partial index's condition, so that SQLite may use it.
SELECT id, idempotency_key FROM tokenline_jobs
WHERE state IN ('succeeded', 'dead', 'cancelled')
  AND state IN (SELECT value FROM json_each(:states))
  AND finished_at < :before
LIMIT :limit;

-- name: prune_jobs_count
SELECT count(*) FROM tokenline_jobs
WHERE state IN ('succeeded', 'dead', 'cancelled')
  AND state IN (SELECT value FROM json_each(:states))
  AND finished_at < :before;

-- name: prune_jobs
-- Rows picked in this same transaction; the state check is a second guard. Its "+"
-- keeps SQLite on the primary key: by the state index it would scan every finished job.
DELETE FROM tokenline_jobs
WHERE id IN (SELECT value FROM json_each(:ids))
  AND +state IN ('succeeded', 'dead', 'cancelled');

-- name: prune_attempts
DELETE FROM tokenline_attempts WHERE job_id IN (SELECT value FROM json_each(:ids));

-- name: prune_unique_keys
-- Only keys the pruned jobs held and that keep nothing out any more: a key held for
-- good (unique="always" without unique_for) stays.
DELETE FROM tokenline_unique_keys
WHERE key IN (SELECT value FROM json_each(:keys))
  AND job_id IN (SELECT value FROM json_each(:ids))
  AND (while_active OR (held_until IS NOT NULL AND held_until <= :now));

-- name: prune_stale_commits
DELETE FROM tokenline_stale_commits
WHERE id IN (SELECT id FROM tokenline_stale_commits WHERE at < :before ORDER BY id LIMIT :limit);

-- name: prune_stale_commits_count
SELECT count(*) FROM tokenline_stale_commits WHERE at < :before;

-- name: prune_duplicates
DELETE FROM tokenline_duplicates
WHERE id IN (SELECT id FROM tokenline_duplicates WHERE at < :before LIMIT :limit);

-- name: prune_duplicates_count
SELECT count(*) FROM tokenline_duplicates WHERE at < :before;

-- name: schedule_advance
-- Moves the mark only forwards: no row comes back when it is already at or past the
-- instant, and then the caller enqueues nothing.
INSERT INTO tokenline_schedules (name, mark, updated_at) VALUES (:name, :instant, :now)
ON CONFLICT (name) DO UPDATE SET mark = excluded.mark, updated_at = excluded.updated_at
WHERE tokenline_schedules.mark < excluded.mark  -- mark
RETURNING name;

-- name: schedule_marks
SELECT name, mark FROM tokenline_schedules ORDER BY name;
-- name: reconcile_unacknowledged
-- Jobs whose fenced transaction committed (an attempt succeeded), still waiting or
-- running on a dead lease. Only the succeeded attempt proves the handler finished: an
-- effect of the job's own key completing proves that effect ran, not what came after
-- it (a retry, a crash), and acknowledging on it would skip the rest of the handler.
SELECT j.id, j.lease_token, j.state FROM tokenline_jobs AS j
WHERE j.state IN ('queued', 'scheduled', 'running')
  AND j.lease_token > 0  -- only a job that ran can have committed: not the backlog
  AND NOT EXISTS (
      SELECT 1 FROM coord.job_leases AS l
      WHERE j.state = 'running' AND l.job_id = j.id AND l.token = j.lease_token
        AND l.expires_at > :now)
  AND EXISTS (SELECT 1 FROM tokenline_attempts AS a
              WHERE a.job_id = j.id AND a.outcome = 'succeeded')
ORDER BY j.id
LIMIT :limit;

-- name: reconcile_pending_effects
-- Effect keys pending past the deadline whose attempt holds no live lease.
SELECT e.key, e.job_id, e.token, e.owner FROM tokenline_effects AS e
WHERE e.status = 'pending' AND e.updated_at <= :now - :deadline
  AND NOT EXISTS (
      SELECT 1 FROM tokenline_jobs AS j JOIN coord.job_leases AS l ON l.job_id = j.id
      WHERE j.id = e.job_id AND j.state = 'running' AND j.lease_token = e.token
        AND l.token = e.token AND l.expires_at > :now)
ORDER BY e.key
LIMIT :limit;

-- name: reconcile_orphan_leases
-- Resource leases still held by a worker whose membership is over: under its own id,
-- or by one of its job attempts through ctx.lease, whose owner is
-- '<worker id>/job<id>/t<token>' (worker/resources.py). The worker's id is compared
-- as an exact prefix, never as a pattern (an id may hold '/', '%', '_', '*'); the rest
-- must be one 'job<digits>/t<digits>' pair, so that a worker whose id extends another's
-- ('w' and 'w/x') never answers for the other's leases. A holder that is not a worker
-- (a dedicated maintenance process, a user's own) is never judged.
SELECT r.resource, r.token, r.owner FROM coord.resource_leases AS r
JOIN coord.workers AS w
  ON w.id = r.owner
  OR (substr(r.owner, 1, length(w.id) + 1) = w.id || '/'
      AND substr(r.owner, length(w.id) + 2) GLOB 'job[0-9]*/t[0-9]*'
      AND substr(r.owner, length(w.id) + 2) NOT GLOB '*/*/*'
      AND substr(r.owner, length(w.id) + 2) NOT GLOB 'job*[^0-9]*/*'
      AND substr(r.owner, length(w.id) + 2) NOT GLOB '*/t*[^0-9]*')
WHERE r.expires_at > :now AND (w.state = 'stopped' OR w.expires_at <= :now)
ORDER BY r.resource
LIMIT :limit;

-- name: reconcile_open_attempts
-- Attempts without an outcome whose job is no longer running under their token.
SELECT a.job_id, a.token, a.owner FROM tokenline_attempts AS a
JOIN tokenline_jobs AS j ON j.id = a.job_id
WHERE a.finished_at IS NULL AND NOT (j.state = 'running' AND j.lease_token = a.token)
ORDER BY a.job_id, a.token
LIMIT :limit;

-- name: repair_take
-- Queued never moves straight to succeeded: the reconciler takes the job first, with a
-- new token, so that no earlier holder matches any more. Only as it was seen.
UPDATE tokenline_jobs SET state = 'running', lease_token = lease_token + 1,
    lease_owner = NULL, updated_at = :now
WHERE id = :job_id AND lease_token = :token AND state = :state
  AND state IN ('queued', 'scheduled');

-- name: repair_acknowledge
-- Conditional on the token seen, and on no live lease for it.
UPDATE tokenline_jobs
SET state = 'succeeded', lease_owner = NULL, lease_expires_at = NULL,
    updated_at = :now, finished_at = :now
WHERE id = :job_id AND lease_token = :token AND state = 'running'
  AND NOT EXISTS (SELECT 1 FROM coord.job_leases AS l
                  WHERE l.job_id = :job_id AND l.token = :token AND l.expires_at > :now);

-- name: repair_attempt_close
-- Only an attempt whose job is no longer running under its token.
UPDATE tokenline_attempts
SET finished_at = :now, outcome = :outcome, error = :error, error_class = 'coordination'
WHERE job_id = :job_id AND token = :token AND finished_at IS NULL
  AND NOT EXISTS (SELECT 1 FROM tokenline_jobs AS j
                  WHERE j.id = :job_id AND j.state = 'running' AND j.lease_token = :token);

-- name: repair_effect_fail
-- Only while still pending under the token seen, whose attempt holds no live lease.
UPDATE tokenline_effects SET status = 'failed', error = :error, updated_at = :now
WHERE key = :key AND status = 'pending' AND job_id = :job_id AND token = :token
  AND NOT EXISTS (
      SELECT 1 FROM tokenline_jobs AS j JOIN coord.job_leases AS l ON l.job_id = j.id
      WHERE j.id = :job_id AND j.state = 'running' AND j.lease_token = :token
        AND l.token = :token AND l.expires_at > :now);
