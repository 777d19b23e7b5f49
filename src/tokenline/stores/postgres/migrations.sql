-- tokenline: PostgreSQL schema migrations, applied in order by _migrations.py.
--
-- Each migration is one named block "migration_NNNN_description"; NNNN is the schema
-- version it produces. A block runs in the same transaction as every other pending
-- block and the version bookkeeping, under an advisory lock, so a schema is never left
-- half-migrated. Never edit a released block: add a new one.
--
-- Placeholders, filled with psycopg.sql (quoted, never pasted text):
--   schema   the schema's identifier
--   job_ids  the job id sequence's name as a string literal (for nextval)
-- Times are double precision epoch seconds, as at the store seam.

-- name: migration_0001_initial
CREATE SEQUENCE {schema}.job_ids AS bigint;

CREATE TABLE {schema}.jobs (
    id               bigint           PRIMARY KEY DEFAULT nextval({job_ids}),
    queue            text             NOT NULL,
    task             text             NOT NULL,
    args             text             NOT NULL,
    idempotency_key  text,
    priority         integer          NOT NULL DEFAULT 0,
    run_at           double precision NOT NULL,
    attempt          integer          NOT NULL DEFAULT 0,
    max_attempts     integer          NOT NULL,
    state            text             NOT NULL CHECK (state IN
                        ('scheduled', 'queued', 'running', 'succeeded', 'dead', 'cancelled')),
    lease_owner      text,
    lease_token      bigint           NOT NULL DEFAULT 0,
    lease_expires_at double precision,
    last_error       text,
    error_class      text,
    created_at       double precision NOT NULL,
    updated_at       double precision NOT NULL,
    finished_at      double precision,
    timeout          double precision
);
ALTER SEQUENCE {schema}.job_ids OWNED BY {schema}.jobs.id;

CREATE INDEX jobs_ready ON {schema}.jobs (queue, priority DESC, run_at, id)
    WHERE state IN ('queued', 'scheduled');
CREATE INDEX jobs_expiry ON {schema}.jobs (lease_expires_at) WHERE state = 'running';
CREATE INDEX jobs_queue_state ON {schema}.jobs (queue, state);

-- The store itself refuses a backwards move, whatever SQL a bug or a stale worker sends.
-- Mirrors tokenline._jobs.ALLOWED_TRANSITIONS.
CREATE FUNCTION {schema}.jobs_monotonic() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.state <> OLD.state AND NOT (
           (OLD.state = 'scheduled' AND NEW.state IN ('queued', 'running', 'cancelled'))
        OR (OLD.state = 'queued'    AND NEW.state IN ('running', 'cancelled'))
        OR (OLD.state = 'running'   AND NEW.state IN ('succeeded', 'dead', 'queued', 'scheduled'))
        OR (OLD.state = 'dead'      AND NEW.state IN ('queued', 'cancelled'))
    ) THEN
        RAISE EXCEPTION 'tokenline: illegal job state transition % -> % (job %)',
            OLD.state, NEW.state, OLD.id
            USING ERRCODE = 'check_violation';
    END IF;
    RETURN NEW;
END
$$;
CREATE TRIGGER jobs_monotonic BEFORE UPDATE OF state ON {schema}.jobs
    FOR EACH ROW EXECUTE FUNCTION {schema}.jobs_monotonic();

-- The store's notion of "now": the caller's clock when one is given (tests inject a
-- fake one), else the database's, so every worker agrees on when a lease expires.
-- statement_timestamp() is fixed for a whole statement: one statement, one "now".
CREATE FUNCTION {schema}.now_epoch(given double precision) RETURNS double precision
    LANGUAGE sql STABLE PARALLEL SAFE
    AS $$ SELECT COALESCE(given, extract(epoch FROM statement_timestamp())::double precision) $$;

CREATE TABLE {schema}.attempts (
    job_id      bigint           NOT NULL REFERENCES {schema}.jobs (id) ON DELETE CASCADE,
    token       bigint           NOT NULL,
    attempt     integer          NOT NULL,
    owner       text             NOT NULL,
    started_at  double precision NOT NULL,
    finished_at double precision,
    outcome     text,
    error       text,
    error_class text,
    PRIMARY KEY (job_id, token)
);

CREATE TABLE {schema}.stale_commits (
    id        bigint           GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    job_id    bigint           NOT NULL,
    token     bigint           NOT NULL,
    owner     text             NOT NULL,
    operation text             NOT NULL,
    at        double precision NOT NULL
);

CREATE TABLE {schema}.paused_queues (
    queue     text             PRIMARY KEY,
    paused_at double precision NOT NULL
);

CREATE TABLE {schema}.workers (
    id           text             PRIMARY KEY,
    host         text             NOT NULL,
    pid          integer          NOT NULL,
    queues       text[]           NOT NULL,
    concurrency  integer          NOT NULL,
    state        text             NOT NULL,
    token        bigint           NOT NULL,
    started_at   double precision NOT NULL,
    heartbeat_at double precision NOT NULL,
    expires_at   double precision NOT NULL,
    in_flight    integer          NOT NULL DEFAULT 0
);

CREATE TABLE {schema}.leases (
    resource   text             PRIMARY KEY,
    owner      text             NOT NULL,
    token      bigint           NOT NULL,
    expires_at double precision NOT NULL
);

-- name: migration_0002_ledger
-- The ledger: unique enqueue keys, effects, fences and the duplicate audit.

-- A unique job's idempotency key, held by the job that took it. No foreign key: the job
-- row is inserted by the same statement that takes the key.
CREATE TABLE {schema}.unique_keys (
    key          text             PRIMARY KEY,
    job_id       bigint           NOT NULL,
    held_until   double precision,
    while_active boolean          NOT NULL DEFAULT false,
    created_at   double precision NOT NULL
);

-- Whether a held key lets go: past held_until, or a while-active holder that finished.
-- A holder row this statement cannot see (inserted by a transaction that committed after
-- our snapshot) counts as active: an invisible job must never free its key.
CREATE FUNCTION {schema}.unique_key_released(
    held_until double precision, while_active boolean, job_id bigint, now double precision
) RETURNS boolean LANGUAGE sql STABLE AS $$
    SELECT (held_until IS NOT NULL AND held_until <= now)
        OR (while_active AND EXISTS (
                SELECT 1 FROM {schema}.jobs AS j
                WHERE j.id = job_id AND j.state IN ('succeeded', 'dead', 'cancelled')))
$$;

CREATE TABLE {schema}.effects (
    key          text             PRIMARY KEY,
    status       text             NOT NULL CHECK (status IN ('pending', 'completed', 'failed')),
    result       text,
    error        text,
    job_id       bigint           NOT NULL,
    token        bigint           NOT NULL,
    owner        text             NOT NULL,
    runs         integer          NOT NULL DEFAULT 1,
    created_at   double precision NOT NULL,
    updated_at   double precision NOT NULL,
    completed_at double precision
);
CREATE INDEX effects_job ON {schema}.effects (job_id);

CREATE TABLE {schema}.fences (
    key        text             NOT NULL,
    issuer     text             NOT NULL,
    token      bigint           NOT NULL,
    job_id     bigint           NOT NULL,
    owner      text             NOT NULL,
    updated_at double precision NOT NULL,
    PRIMARY KEY (key, issuer)
);

CREATE TABLE {schema}.duplicates (
    id        bigint           GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    key       text             NOT NULL,
    kind      text             NOT NULL CHECK (kind IN ('repeat', 'stale')),
    operation text             NOT NULL,
    job_id    bigint,
    token     bigint           NOT NULL,
    owner     text             NOT NULL,
    at        double precision NOT NULL
);
CREATE INDEX duplicates_at ON {schema}.duplicates (at);

-- name: migration_0003_clock_skew
-- Each worker's wall clock against the database's, as the worker last measured it.
ALTER TABLE {schema}.workers ADD COLUMN clock_skew double precision;

-- name: migration_0004_lease_expiries
-- A lost lease counts toward its own limit, not toward the job's attempts.
ALTER TABLE {schema}.jobs
    ADD COLUMN lease_expiries     integer NOT NULL DEFAULT 0,
    ADD COLUMN max_lease_expiries integer NOT NULL DEFAULT 3;

-- name: migration_0005_worker_drain
-- An operator's request that a worker drain (tokenline drain), read at its heartbeat.
ALTER TABLE {schema}.workers ADD COLUMN drain_requested boolean NOT NULL DEFAULT false;

-- name: migration_0006_lease_acquired_at
-- When each resource lease's current token was issued (NULL: before it was recorded).
ALTER TABLE {schema}.leases ADD COLUMN acquired_at double precision;

-- name: migration_0007_worker_concurrency_limit
-- Each worker's adaptive concurrency limit, as its heartbeat last reported it (NULL:
-- not reported yet).
ALTER TABLE {schema}.workers ADD COLUMN concurrency_limit integer;

-- name: migration_0008_priority_aging
-- Priority aging: the age of a queue's oldest ready job, read in one index step,
-- bounds how far aging can lift any of its jobs (see the claim query).
CREATE INDEX jobs_ready_age ON {schema}.jobs (queue, run_at)
    WHERE state IN ('queued', 'scheduled');

-- name: migration_0009_retention_schedules
-- Retention: finished jobs are found per state and age in one index range. Periodic
-- jobs: each schedule's high-water mark, the last instant it handled (scheduler.py).
CREATE INDEX jobs_finished ON {schema}.jobs (state, finished_at)
    WHERE state IN ('succeeded', 'dead', 'cancelled');
CREATE TABLE {schema}.schedules (
    name       text             PRIMARY KEY,
    mark       double precision NOT NULL,
    updated_at double precision NOT NULL
);

-- name: migration_0010_ready_age_index_for_oldest_only
-- jobs_ready_age answers one question, the age of a queue's oldest ready job. Under
-- statistics that put the queue near empty (a table never analyzed, or analyzed while
-- the queue was empty), the planner also took it for the claim's ordered read: it read
-- the whole backlog by run_at and sorted it on every claim (30 ms a claim at 40,000
-- queued, against 2 ms through jobs_ready). Its predicate now adds a condition that
-- every row meets (priority is a NOT NULL integer) and that only the oldest-job query
-- writes out, so no other query can use the index. Building it reads the jobs table
-- once, holding off writes to it meanwhile.
DROP INDEX {schema}.jobs_ready_age;
CREATE INDEX jobs_ready_age ON {schema}.jobs (queue, run_at)
    WHERE state IN ('queued', 'scheduled') AND priority >= -2147483648;

-- name: migration_0011_top_runnable_priority
-- The highest priority of a queue that has a job runnable at `at` (NULL: none): one seek
-- in jobs_ready per priority present from the top (the oldest job of each, which is
-- runnable if any of that priority is). The claim reads jobs_ready from there down, so
-- a backlog of jobs not yet runnable (delayed, backing off) of higher priorities is
-- stepped over a priority at a time instead of a job at a time (3.3 against 10.9 ms for
-- a claim of 50 under 100,000 of them, seen). A function, not a recursive query in the
-- claim:
-- the planner costs it as one call, where a recursive query's guessed size made the
-- plan kept for every call look dearer than planning each call afresh.
CREATE FUNCTION {schema}.top_runnable_priority(q text, at double precision)
    RETURNS integer LANGUAGE plpgsql STABLE AS $$
DECLARE
    p integer;
    r double precision;
BEGIN
    SELECT j.priority, j.run_at INTO p, r FROM {schema}.jobs AS j
    WHERE j.queue = q AND j.state IN ('queued', 'scheduled')
    ORDER BY j.priority DESC, j.run_at, j.id
    LIMIT 1;
    WHILE p IS NOT NULL AND r > at LOOP
        SELECT j.priority, j.run_at INTO p, r FROM {schema}.jobs AS j
        WHERE j.queue = q AND j.state IN ('queued', 'scheduled') AND j.priority < p
        ORDER BY j.priority DESC, j.run_at, j.id
        LIMIT 1;
        IF NOT FOUND THEN
            RETURN NULL;
        END IF;
    END LOOP;
    RETURN p;
END
$$;

-- name: migration_0012_runnable_jobs
-- The claim's first read, per queue: the best `lim` runnable jobs by priority alone
-- (priority descending, then run_at, then id), locked, those another claimer holds
-- skipped. Priority by priority from the top: one seek for the oldest job of the next
-- priority present (runnable if any of that priority is), then that priority's
-- runnable jobs as one range of jobs_ready (run_at up to `at`). The one scan across
-- priorities it replaces stepped over each job not yet runnable of every priority it
-- read, one entry at a time: with 100,000 delayed jobs of a priority above the rest
-- and one of them come due, a claim of 50 took 17.6-21.0 ms, against 5.6-6.7 ms now.
-- Volatile, as it locks rows, so each statement in it takes its own snapshot: a job
-- it locks that the claim's snapshot does not show yet stays queued, unclaimed, and is
-- unlocked when the claim ends.
CREATE FUNCTION {schema}.runnable_jobs(q text, at double precision, lim integer)
    RETURNS TABLE (job_id bigint, job_priority integer, job_run_at double precision)
    LANGUAGE plpgsql COST 1 ROWS 16 AS $$
DECLARE
    p integer;
    r double precision;
    got integer := 0;
    n integer;
BEGIN
    SELECT j.priority, j.run_at INTO p, r FROM {schema}.jobs AS j
    WHERE j.queue = q AND j.state IN ('queued', 'scheduled')
    ORDER BY j.priority DESC, j.run_at, j.id
    LIMIT 1;
    -- No row found sets p to NULL.
    WHILE p IS NOT NULL LOOP
        IF r <= at THEN
            RETURN QUERY
                SELECT j.id, j.priority, j.run_at FROM {schema}.jobs AS j
                WHERE j.queue = q AND j.priority = p AND j.state IN ('queued', 'scheduled')
                  AND j.run_at <= at
                ORDER BY j.run_at, j.id
                LIMIT lim - got
                -- NO KEY UPDATE, not UPDATE: the KEY SHARE lock of a fenced transaction
                -- left open by a rescued attempt's paused or cut-off owner must not hide
                -- the job.
                FOR NO KEY UPDATE OF j SKIP LOCKED;
            GET DIAGNOSTICS n = ROW_COUNT;
            got := got + n;
            EXIT WHEN got >= lim;
        END IF;
        SELECT j.priority, j.run_at INTO p, r FROM {schema}.jobs AS j
        WHERE j.queue = q AND j.state IN ('queued', 'scheduled') AND j.priority < p
        ORDER BY j.priority DESC, j.run_at, j.id
        LIMIT 1;
    END LOOP;
END
$$;

-- name: migration_0013_state_check_in_trigger_condition
-- The state check moves into the trigger's WHEN condition, which the executor evaluates
-- as a plain expression: the plpgsql function ran for every updated row, about 4 µs
-- each, and a claim and a finish each update every job's state. It now runs only to
-- refuse an illegal move, with the same message. The same transitions, mirroring
-- tokenline._jobs.ALLOWED_TRANSITIONS.
CREATE OR REPLACE FUNCTION {schema}.jobs_monotonic() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'tokenline: illegal job state transition % -> % (job %)',
        OLD.state, NEW.state, OLD.id
        USING ERRCODE = 'check_violation';
END
$$;
DROP TRIGGER jobs_monotonic ON {schema}.jobs;
CREATE TRIGGER jobs_monotonic BEFORE UPDATE OF state ON {schema}.jobs
    FOR EACH ROW
    WHEN (NEW.state <> OLD.state AND NOT (
           (OLD.state = 'scheduled' AND NEW.state IN ('queued', 'running', 'cancelled'))
        OR (OLD.state = 'queued'    AND NEW.state IN ('running', 'cancelled'))
        OR (OLD.state = 'running'   AND NEW.state IN ('succeeded', 'dead', 'queued', 'scheduled'))
        OR (OLD.state = 'dead'      AND NEW.state IN ('queued', 'cancelled'))
    ))
    EXECUTE FUNCTION {schema}.jobs_monotonic();

-- name: migration_0014_fenced_transaction_block_guard
-- A row per open fenced transaction (ctx.transaction()), inserted by its first
-- statement and deleted by the block's end just before the completion, in the same
-- transaction: the table is empty but for transactions in flight, and unlogged, as
-- nothing in it outlives its transaction. A COMMIT sent by the handler inside the
-- block would make its writes durable without the job's completion (and the retry
-- would write them again): the deferred check refuses any commit that finds the
-- transaction's row still there, so that COMMIT fails and everything rolls back. A
-- ROLLBACK inside the block takes the row with it, which the block's end sees.
CREATE UNLOGGED TABLE {schema}.open_blocks (xact bigint NOT NULL);
CREATE INDEX open_blocks_xact ON {schema}.open_blocks (xact);
CREATE FUNCTION {schema}.block_closed() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF EXISTS (SELECT 1 FROM {schema}.open_blocks WHERE xact = NEW.xact) THEN
        RAISE EXCEPTION 'tokenline: COMMIT inside `with ctx.transaction()` is refused '
            '(so is SET CONSTRAINTS ALL IMMEDIATE, which would check this now: name your '
            'own constraints): leaving the block commits its writes together with the '
            'job''s completion'
            USING ERRCODE = 'invalid_transaction_termination';
    END IF;
    RETURN NULL;
END
$$;
CREATE CONSTRAINT TRIGGER open_blocks_closed AFTER INSERT ON {schema}.open_blocks
    DEFERRABLE INITIALLY DEFERRED
    FOR EACH ROW EXECUTE FUNCTION {schema}.block_closed();
