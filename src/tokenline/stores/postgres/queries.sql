-- tokenline: PostgreSQL queries. Every finalising write is conditional on the job's
-- lease token inside the statement itself; see stores/base.py for the contract.
--
-- Parameters are psycopg's %(name)s; batches arrive as arrays and are read with
-- unnest(...) WITH ORDINALITY, so one statement serves a whole batch and each row
-- keeps its place. Placeholders in braces are filled once per store with psycopg.sql
-- (see migrations.sql). Every time is schema.now_epoch(now): the caller's clock when
-- the store was given one, else the database's.
--
-- Lines ending in "-- fence" hold a token check (the tests prove, by removing them from
-- a copy, that the drill notices).

-- name: schema_exists
SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_namespace WHERE nspname = %(schema)s);

-- name: schema_create
CREATE SCHEMA {schema};

-- name: version_table_exists
SELECT EXISTS (
    SELECT 1 FROM pg_catalog.pg_tables
    WHERE schemaname = %(schema)s AND tablename = 'schema_version'
);

-- name: version_table_create
CREATE TABLE IF NOT EXISTS {schema}.schema_version (
    version    integer     PRIMARY KEY,
    name       text        NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now()
);

-- name: version_current
SELECT COALESCE(max(version), 0) FROM {schema}.schema_version;

-- name: version_record
INSERT INTO {schema}.schema_version (version, name) VALUES (%(version)s, %(name)s);

-- name: migrate_lock
-- Held to the end of the migrating transaction: concurrent starters wait, then find the
-- schema current. Keyed by schema, so apps sharing a database do not wait on each other.
SELECT pg_advisory_xact_lock(hashtextextended('tokenline migrate ' || %(schema)s, 0));

-- name: enqueue
WITH input AS (
    SELECT *
    FROM unnest(%(queue)s::text[], %(task)s::text[], %(args)s::text[],
                %(idempotency_key)s::text[], %(priority)s::integer[],
                %(run_at)s::double precision[], %(delay)s::double precision[],
                %(max_attempts)s::integer[], %(timeout)s::double precision[],
                %(unique)s::text[], %(unique_for)s::double precision[],
                %(max_lease_expiries)s::integer[])
         WITH ORDINALITY AS i (queue, task, args, idempotency_key, priority, given_run_at,
                               delay, max_attempts, timeout, uniq, unique_for,
                               max_lease_expiries, ord)
),
-- Ids are drawn first and handed out in ascending input order, so the caller gets
-- them back in the order it sent the jobs, whatever order the rows are inserted in.
drawn AS (
    SELECT array_agg(id ORDER BY id) AS ids
    FROM (SELECT nextval({job_ids}) AS id FROM input) AS n
),
clock AS (SELECT {schema}.now_epoch(%(now)s) AS now),
-- A delay is a duration from the database's now; an explicit run_at stays absolute.
timed AS (
    SELECT i.*, COALESCE(i.given_run_at, c.now + COALESCE(i.delay, 0)) AS run_at
    FROM input AS i, clock AS c
),
-- Unique jobs take their key first (the first of a batch per key). The primary key makes
-- concurrent enqueuers of one key wait for each other; ON CONFLICT then locks the held
-- row and keeps its holder unless unique_key_released says it let go. The update always
-- happens, so RETURNING names the holder even when it is another transaction's job.
keys AS (
    INSERT INTO {schema}.unique_keys AS k (key, job_id, held_until, while_active, created_at)
    SELECT DISTINCT ON (i.idempotency_key)
           i.idempotency_key, d.ids[i.ord::integer], c.now + i.unique_for,
           i.uniq = 'active', c.now
    FROM input AS i, drawn AS d, clock AS c
    WHERE i.uniq IS NOT NULL
    ORDER BY i.idempotency_key, i.ord
    {unique_key_take}
),
inserted AS (
    INSERT INTO {schema}.jobs (id, queue, task, args, idempotency_key, priority, run_at,
                               max_attempts, state, created_at, updated_at, timeout,
                               max_lease_expiries)
    SELECT d.ids[i.ord::integer], i.queue, i.task, i.args, i.idempotency_key, i.priority,
           i.run_at, i.max_attempts,
           CASE WHEN i.run_at > c.now THEN 'scheduled' ELSE 'queued' END,
           c.now, c.now, i.timeout, i.max_lease_expiries
    FROM timed AS i, drawn AS d, clock AS c
    WHERE i.uniq IS NULL OR d.ids[i.ord::integer] IN (SELECT job_id FROM keys)
    RETURNING id, queue, state
),
-- NOTIFY is transactional: listeners hear of the jobs only once they are committed.
-- Only with %(notify)s: tokenline's own enqueues notify after their commit (_notifier.py).
notified AS (
    SELECT count(pg_notify(%(channel)s, q.queue)) AS n
    FROM (SELECT DISTINCT queue FROM inserted WHERE state = 'queued') AS q
    WHERE %(notify)s::boolean
)
-- Each job's id (its key's holder's, if another job holds it) and whether it went in
-- ready now (for the notification sent after the commit).
SELECT COALESCE(k.job_id, d.ids[i.ord::integer]) AS id,
       COALESCE(k.job_id = d.ids[i.ord::integer], true) AND i.run_at <= c.now AS ready
FROM timed AS i
     CROSS JOIN drawn AS d
     CROSS JOIN clock AS c
     CROSS JOIN notified
     LEFT JOIN keys AS k ON i.uniq IS NOT NULL AND k.key = i.idempotency_key
ORDER BY i.ord;

-- name: enqueue_one
-- One job without a unique key, the common single enqueue from web code: the same row
-- and NOTIFY as enqueue, without its arrays and key table.
WITH clock AS (SELECT {schema}.now_epoch(%(now)s) AS now),
timed AS (
    SELECT c.now,
           COALESCE(%(run_at)s::double precision,
                    c.now + COALESCE(%(delay)s::double precision, 0)) AS run_at
    FROM clock AS c
),
inserted AS (
    INSERT INTO {schema}.jobs (queue, task, args, idempotency_key, priority, run_at,
                               max_attempts, state, created_at, updated_at, timeout,
                               max_lease_expiries)
    SELECT %(queue)s::text, %(task)s::text, %(args)s::text, %(idempotency_key)s::text,
           %(priority)s::integer, t.run_at, %(max_attempts)s::integer,
           CASE WHEN t.run_at > t.now THEN 'scheduled' ELSE 'queued' END,
           t.now, t.now, %(timeout)s::double precision, %(max_lease_expiries)s::integer
    FROM timed AS t
    RETURNING id, queue, state
)
-- NOTIFY is transactional: listeners hear of the job only once it is committed. Only
-- with %(notify)s: tokenline's own enqueues notify after their commit (_notifier.py).
SELECT id, state = 'queued' AS ready,
       CASE WHEN state = 'queued' AND %(notify)s::boolean
            THEN pg_notify(%(channel)s, queue) END
FROM inserted;

-- name: enqueue_ids
-- A large batch is copied in (enqueue_copy): its ids are drawn first,
-- one per job, with the store's now for its run_at and state.
SELECT ARRAY(SELECT nextval({job_ids}) FROM generate_series(1, %(n)s)) AS ids,
       {schema}.now_epoch(%(now)s) AS now;

-- name: enqueue_copy
-- In binary form: no float or integer is printed and parsed again (the column types
-- are ENQUEUE_COPY_TYPES in store.py, in this order).
COPY {schema}.jobs (id, queue, task, args, idempotency_key, priority, run_at,
                    max_attempts, state, created_at, updated_at, timeout,
                    max_lease_expiries)
FROM STDIN (FORMAT BINARY);

-- name: unique_key_take
-- Not a statement: the end of the INSERT into unique_keys of enqueue and enqueue_keys,
-- put in place of {unique_key_take} when the queries are loaded.
ON CONFLICT (key) DO UPDATE
SET job_id = CASE WHEN {schema}.unique_key_released(
                      k.held_until, k.while_active, k.job_id, excluded.created_at)
                  THEN excluded.job_id ELSE k.job_id END,
    held_until = CASE WHEN {schema}.unique_key_released(
                          k.held_until, k.while_active, k.job_id, excluded.created_at)
                      THEN excluded.held_until ELSE k.held_until END,
    while_active = CASE WHEN {schema}.unique_key_released(
                            k.held_until, k.while_active, k.job_id, excluded.created_at)
                        THEN excluded.while_active ELSE k.while_active END,
    created_at = CASE WHEN {schema}.unique_key_released(
                          k.held_until, k.while_active, k.job_id, excluded.created_at)
                      THEN excluded.created_at ELSE k.created_at END
RETURNING k.key, k.job_id

-- name: enqueue_keys
-- The unique keys of a batch copied in (enqueue_copy), before its rows: each key taken,
-- under the rules of enqueue's keys, for the first job of the batch that names it (the
-- caller sends each key once, with that job). Answers only the keys another job holds,
-- with that holder (usually none: a row per key would cost more to send and read than
-- taking the key); the caller copies in only the jobs holding their key. Keys are taken
-- in enqueue's order (by key), so that two batches naming the same keys never wait for
-- each other in a cycle.
WITH i AS (
    SELECT *
    FROM unnest(%(key)s::text[], %(job_id)s::bigint[], %(uniq)s::text[],
                %(unique_for)s::double precision[]) AS i (key, job_id, uniq, unique_for)
),
taken AS (
    INSERT INTO {schema}.unique_keys AS k (key, job_id, held_until, while_active,
                                           created_at)
    SELECT i.key, i.job_id, %(now)s::double precision + i.unique_for, i.uniq = 'active',
           %(now)s::double precision
    FROM i
    ORDER BY i.key
    {unique_key_take}
)
SELECT t.key, t.job_id FROM taken AS t JOIN i ON i.key = t.key WHERE t.job_id <> i.job_id;

-- name: enqueue_notify
-- NOTIFY is transactional: listeners hear of the jobs only once they are committed.
-- Also sent on its own, after the commit of the enqueue it announces (_notifier.py).
SELECT count(pg_notify(%(channel)s, q.queue)) FROM unnest(%(queues)s::text[]) AS q (queue);

-- name: claim
-- SKIP LOCKED: concurrent claimers never wait on each other and never take the same
-- row; the token bump and the attempt row happen in this same statement.
-- Never a scan and sort of the whole backlog: a claim costs the same with a million
-- jobs queued as with ten. Per unpaused queue (LATERAL), ordered index scans that stop
-- at the limit read the rows the best `limit` by effective priority are among (the
-- argument is in stores/sqlite/_claim.py, which reads the same rows):
--   by_priority  the best `limit` by priority alone (jobs_ready), as without aging,
--                locked, read by runnable_jobs (migration 0012) a priority at a time:
--                a seek per priority present, then a range of its runnable jobs;
--   reach        only for a queue whose by_priority is full, with %(aging)s set: how
--                many points aging can lift any of its jobs, from the age of its oldest
--                ready job (one step of jobs_ready_age);
--   levels       the priorities present from the lowest of by_priority down to that
--                many points below it, one seek per priority present (a loose index
--                scan), never one per number in between nor per job not yet runnable;
--   by_age       the `limit` oldest runnable jobs of each of those priorities.
-- Rows locked by these scans but not picked stay untouched, unlocked when the claim's
-- transaction ends.
-- A small claim has its size written into the text in place of %(limit)s (see
-- with_claim_limit in store.py). Given a LIMIT it cannot see, the planner takes the
-- claim for a tenth of the table: it plans each call afresh, which costs more than the
-- claim itself, or keeps a plan, made while the table was small, that joins the picked
-- rows to a scan of the whole table once it has grown (26 ms against 0.5 ms for one job
-- of 200,000, seen before an ANALYZE); with the number, its plan reads only indexes.
WITH RECURSIVE clock AS (SELECT {schema}.now_epoch(%(now)s) AS now),
open_queues AS (
    SELECT q.name
    FROM unnest(%(queues)s::text[]) AS q (name)
    WHERE NOT EXISTS (SELECT 1 FROM {schema}.paused_queues AS p WHERE p.queue = q.name)
),
by_priority AS MATERIALIZED (
    SELECT oq.name AS queue, cand.job_id AS id, cand.job_priority AS priority,
           cand.job_run_at AS run_at
    FROM open_queues AS oq, clock AS c,
    -- The function returns at most the limit; the LIMIT tells the planner so, as the
    -- scan it replaces did (see the note on small claims above).
    LATERAL (
        SELECT * FROM {schema}.runnable_jobs(oq.name, c.now, %(limit)s) LIMIT %(limit)s
    ) AS cand
),
reach AS (
    -- bigint, to compare with priorities inside the index; more points than the
    -- whole range of priorities (2^32) would reach no further.
    SELECT full_queue.queue, full_queue.lowest,
           least(floor((c.now - oldest.run_at) / %(aging)s::double precision),
                 4294967296)::bigint AS points
    FROM (SELECT b.queue, min(b.priority) AS lowest
          FROM by_priority AS b
          GROUP BY b.queue
          HAVING count(*) >= %(limit)s) AS full_queue,
         clock AS c,
    LATERAL (
        SELECT j.run_at
        FROM {schema}.jobs AS j
        WHERE j.queue = full_queue.queue AND j.state IN ('queued', 'scheduled')
          -- True of every row: it names jobs_ready_age's predicate, which no other
          -- query writes out (migration 0010), so only this query can use that index.
          AND j.priority >= -2147483648
        ORDER BY j.run_at
        LIMIT 1
    ) AS oldest
    WHERE %(aging)s::double precision IS NOT NULL
),
levels (queue, priority, lowest) AS (
    SELECT r.queue, r.lowest, r.lowest - r.points FROM reach AS r WHERE r.points > 0
    UNION ALL
    SELECT l.queue, nxt.priority, l.lowest
    FROM levels AS l,
    LATERAL (
        SELECT j.priority
        FROM {schema}.jobs AS j
        WHERE j.queue = l.queue
          AND j.state IN ('queued', 'scheduled')
          AND j.priority < l.priority
          AND j.priority >= l.lowest
        ORDER BY j.priority DESC, j.run_at, j.id
        LIMIT 1
    ) AS nxt
),
by_age AS MATERIALIZED (
    SELECT l.queue, cand.id, cand.priority, cand.run_at
    FROM levels AS l, clock AS c,
    LATERAL (
        SELECT j.id, j.priority, j.run_at
        FROM {schema}.jobs AS j
        WHERE j.queue = l.queue
          AND j.priority = l.priority
          AND j.state IN ('queued', 'scheduled')
          AND j.run_at <= c.now
        ORDER BY j.run_at, j.id
        LIMIT %(limit)s
        FOR NO KEY UPDATE OF j SKIP LOCKED
    ) AS cand
),
-- Effective priority, as tokenline._jobs.claim_key ranks it.
picked AS MATERIALIZED (
    SELECT u.id
    FROM (SELECT id, priority, run_at FROM by_priority
          UNION
          SELECT id, priority, run_at FROM by_age) AS u,
         clock AS c
    ORDER BY u.priority
             + COALESCE(floor((c.now - u.run_at) / %(aging)s::double precision), 0) DESC,
             u.run_at, u.id
    LIMIT %(limit)s
),
claimed AS (
    UPDATE {schema}.jobs AS j
    SET state = 'running',
        attempt = j.attempt + 1,
        lease_owner = %(owner)s,
        lease_token = j.lease_token + 1,
        lease_expires_at = c.now + %(ttl)s,
        updated_at = c.now
    FROM picked AS p, clock AS c
    WHERE j.id = p.id
    RETURNING j.*
),
attempt_rows AS (
    INSERT INTO {schema}.attempts (job_id, token, attempt, owner, started_at)
    SELECT id, lease_token, attempt, lease_owner, updated_at FROM claimed
)
SELECT cl.*
FROM claimed AS cl, clock AS c
ORDER BY cl.priority
         + COALESCE(floor((c.now - cl.run_at) / %(aging)s::double precision), 0) DESC,
         cl.run_at, cl.id;

-- name: job_leases_renew
WITH input AS (
    SELECT *
    FROM unnest(%(job_id)s::bigint[], %(token)s::bigint[], %(lease_owner)s::text[])
         WITH ORDINALITY AS l (job_id, token, owner, ord)
),
clock AS (SELECT {schema}.now_epoch(%(now)s) AS now),
-- Row locks in id order: a renewal batch and a finish batch of the same worker, on two
-- connections, can never deadlock. FOR UPDATE reads the newest committed version of
-- each row, which is what "who holds it now" below must see. `= ANY` of the array, not
-- `IN (SELECT … FROM input)`: a plan the server keeps for every call (made without the
-- array's values) then reads the rows by primary key, where the IN form's, kept from a
-- small table, went on scanning the whole table as it grew (a finish took 22 ms
-- against 0.5 ms at 200,000 jobs, seen).
locked AS MATERIALIZED (
    SELECT j.id, j.lease_token, j.lease_owner FROM {schema}.jobs AS j
    WHERE j.id = ANY (%(job_id)s::bigint[])
    ORDER BY j.id
    FOR NO KEY UPDATE
),
renewed AS (
    UPDATE {schema}.jobs AS j
    SET lease_expires_at = c.now + %(ttl)s, updated_at = c.now
    FROM input AS l, locked AS k, clock AS c
    WHERE j.id = l.job_id AND k.id = j.id
      AND l.owner = %(owner)s
      AND j.lease_token = l.token AND j.lease_owner = l.owner  -- fence
      AND j.state = 'running'
      AND j.lease_expires_at > c.now
    RETURNING l.ord, j.lease_expires_at
)
-- Refused renewals come back with who holds the job now: the core decides which were
-- stale (tokenline._jobs.renewal_was_stale), and the store records those.
SELECT l.ord, r.lease_expires_at, k.lease_token, k.lease_owner
FROM input AS l
     LEFT JOIN renewed AS r ON r.ord = l.ord
     LEFT JOIN locked AS k ON k.id = l.job_id
ORDER BY l.ord;

-- name: stale_insert_many
INSERT INTO {schema}.stale_commits (job_id, token, owner, operation, at)
SELECT s.job_id, s.token, s.owner, %(operation)s, {schema}.now_epoch(%(now)s)
FROM unnest(%(job_id)s::bigint[], %(token)s::bigint[], %(lease_owner)s::text[])
     AS s (job_id, token, owner);

-- name: finish
-- One statement for the whole batch; each row applies only if its own token, owner and
-- the running state still match. Refused rows are recorded as stale commits. What each
-- outcome does to the row (state, delay, refund, final) is decided by the core
-- (tokenline._jobs.finish_transition) and arrives here as data.
WITH input AS (
    SELECT *
    FROM unnest(%(job_id)s::bigint[], %(token)s::bigint[], %(lease_owner)s::text[],
                %(outcome)s::text[], %(state)s::text[], %(delay)s::double precision[],
                %(refund)s::integer[], %(final)s::boolean[], %(error)s::text[],
                %(error_class)s::text[])
         WITH ORDINALITY AS f (job_id, token, owner, outcome, state, delay, refund, final,
                               error, error_class, ord)
),
clock AS (SELECT {schema}.now_epoch(%(now)s) AS now),
-- By primary key from the array, as in job_leases_renew. Locked, each row is read in
-- its newest committed version, and stays so until the commit: its token, owner and
-- state are checked here, on what the update below changes.
locked AS MATERIALIZED (
    SELECT j.id, j.lease_token, j.lease_owner, j.state FROM {schema}.jobs AS j
    WHERE j.id = ANY (%(job_id)s::bigint[])
    ORDER BY j.id
    FOR NO KEY UPDATE
),
-- The update finds its rows by primary key and nothing else: with a condition on the
-- state of `j` itself, the plan the server keeps (made for a batch of unknown size)
-- read every running job through jobs_expiry, then kept only the batch's.
done AS (
    UPDATE {schema}.jobs AS j
    SET state = f.state,
        run_at = CASE WHEN f.delay IS NULL THEN j.run_at ELSE c.now + f.delay END,
        attempt = j.attempt - f.refund,
        lease_owner = NULL,
        lease_expires_at = NULL,
        last_error = f.error,
        error_class = f.error_class,
        finished_at = CASE WHEN f.final THEN c.now END,
        updated_at = c.now
    FROM input AS f, locked AS k, clock AS c
    WHERE j.id = k.id AND k.id = f.job_id
      AND k.lease_token = f.token AND k.lease_owner = f.owner  -- fence
      AND k.state = 'running'
    RETURNING f.ord, j.id, f.token, f.outcome, f.error, f.error_class
),
closed AS (
    UPDATE {schema}.attempts AS a
    SET finished_at = c.now, outcome = d.outcome, error = d.error, error_class = d.error_class
    FROM done AS d, clock AS c
    WHERE a.job_id = d.id AND a.token = d.token AND a.finished_at IS NULL
),
stale AS (
    INSERT INTO {schema}.stale_commits (job_id, token, owner, operation, at)
    SELECT f.job_id, f.token, f.owner, f.outcome, c.now
    FROM input AS f, clock AS c
    WHERE f.ord NOT IN (SELECT ord FROM done)
    ORDER BY f.ord
)
SELECT ord FROM done;

-- name: fence_check
-- First statement of a ledger write's transaction: proves the token and locks the job
-- row until commit, so no rescue or stale finish can slip in between the check and the
-- write. NO KEY UPDATE: it waits for a rescue, not for a fenced transaction's KEY SHARE.
SELECT id FROM {schema}.jobs
WHERE id = %(job_id)s
  AND lease_token = %(token)s AND lease_owner = %(owner)s  -- fence
  AND state = 'running'
FOR NO KEY UPDATE;

-- name: transaction_begin
-- First statement of a fenced transaction (see _transaction.py): proves the token and
-- takes only a KEY SHARE lock on the job row. Renewals, other jobs' finishes and the
-- rescue update no key column, so none of them waits for a transaction left open: the
-- job keeps its lease however long the transaction lasts, and a rescued attempt's
-- transaction cannot keep its job from being rescued. The session is named after the
-- attempt, so that a rescue can end it, and may stay open (or run a statement) for the
-- attempt's remaining time instead of the store timeout. It also opens the block's guard
-- (migration 0014), which transaction_block_close closes.
WITH guard AS (INSERT INTO {schema}.open_blocks (xact) VALUES (txid_current()))
SELECT id,
       set_config('application_name', %(session)s, true),
       set_config('statement_timeout',
                  COALESCE(%(timeout_ms)s, current_setting('statement_timeout')), true),
       set_config('idle_in_transaction_session_timeout',
                  COALESCE(%(timeout_ms)s,
                           current_setting('idle_in_transaction_session_timeout')), true)
FROM {schema}.jobs
WHERE id = %(job_id)s
  AND lease_token = %(token)s AND lease_owner = %(owner)s  -- fence
  AND state = 'running'
FOR KEY SHARE;

-- name: transaction_block_close
-- The end of a fenced transaction's block, before the completion: a row when the
-- transaction the block was given is still the one open (none: the block ended it).
DELETE FROM {schema}.open_blocks WHERE xact = txid_current() RETURNING xact;

-- name: stale_insert
INSERT INTO {schema}.stale_commits (job_id, token, owner, operation, at)
VALUES (%(job_id)s, %(token)s, %(owner)s, %(operation)s, {schema}.now_epoch(%(now)s));

-- name: rescue_candidates
-- SKIP LOCKED: a job whose owner is committing right now is left to that commit. NO KEY
-- UPDATE, not UPDATE: a fenced transaction's KEY SHARE lock (left open by a paused or
-- cut-off owner) must not keep its job from being rescued.
SELECT j.id, j.lease_token, j.lease_owner, j.attempt, j.max_attempts, j.lease_expiries,
       j.max_lease_expiries
FROM {schema}.jobs AS j
WHERE j.state = 'running' AND j.lease_expires_at <= {schema}.now_epoch(%(now)s)
ORDER BY j.lease_expires_at, j.id
LIMIT %(limit)s
FOR NO KEY UPDATE OF j SKIP LOCKED;

-- name: rescue_blocked
-- Expired leases the candidates above skipped: a row lock holds them, and only the
-- attempt's own fenced transaction takes one that lasts (its completion UPDATE ran, its
-- COMMIT has not come: the owner was paused or cut off at that moment, and the session
-- may stay idle for the attempt's whole timeout). The lease has expired by this clock,
-- so that attempt owns nothing: the rescue ends its session (rolling it back), and the
-- next rescue takes the job. Without this, ownership would outlast the lease.
SELECT j.id, j.lease_token
FROM {schema}.jobs AS j
WHERE j.state = 'running' AND j.lease_expires_at <= {schema}.now_epoch(%(now)s)
  AND NOT (j.id = ANY(%(taken)s::bigint[]))
ORDER BY j.lease_expires_at, j.id
LIMIT %(limit)s;

-- name: rescue
-- Applies the core's decision for each candidate (tokenline._jobs.rescue_transition),
-- in the transaction that locked them; the token is checked again anyway.
WITH input AS (
    SELECT *
    FROM unnest(%(job_id)s::bigint[], %(token)s::bigint[], %(state)s::text[],
                %(refund)s::integer[], %(final)s::boolean[], %(error)s::text[],
                %(delay)s::double precision[])
         AS r (job_id, token, state, refund, final, error, delay)
),
clock AS (SELECT {schema}.now_epoch(%(now)s) AS now),
closed AS (
    UPDATE {schema}.attempts AS a
    SET finished_at = c.now, outcome = 'lease_expired', error = r.error,
        error_class = 'coordination'
    FROM input AS r, clock AS c
    WHERE a.job_id = r.job_id AND a.token = r.token AND a.finished_at IS NULL
),
rescued AS (
    UPDATE {schema}.jobs AS j
    SET state = r.state,
        finished_at = CASE WHEN r.final THEN c.now END,
        attempt = j.attempt - r.refund,
        lease_expiries = j.lease_expiries + 1,
        lease_token = j.lease_token + 1,
        lease_owner = NULL,
        lease_expires_at = NULL,
        run_at = CASE WHEN r.delay IS NULL THEN j.run_at ELSE c.now + r.delay END,
        last_error = r.error,
        error_class = 'coordination',
        updated_at = c.now
    FROM input AS r, clock AS c
    WHERE j.id = r.job_id AND j.lease_token = r.token AND j.state = 'running'
    RETURNING j.id, j.state, j.queue, r.token
),
notified AS (
    SELECT count(pg_notify(%(channel)s, q.queue)) AS n
    FROM (SELECT DISTINCT queue FROM rescued WHERE state = 'queued') AS q
)
SELECT rescued.id, rescued.state, rescued.token FROM rescued, notified ORDER BY rescued.id;

-- name: sessions_terminate
-- Fenced transactions of rescued attempts still open (their owner paused or cut off):
-- their commit would be refused anyway; ending them releases the locks they hold on
-- the user's own rows at once instead of when the server notices the client is gone.
SELECT count(*) FILTER (WHERE pg_terminate_backend(a.pid))
FROM pg_stat_activity AS a
WHERE a.application_name = ANY(%(sessions)s::text[]) AND a.pid <> pg_backend_pid();

-- name: pause
INSERT INTO {schema}.paused_queues (queue, paused_at)
VALUES (%(queue)s, {schema}.now_epoch(%(now)s))
ON CONFLICT (queue) DO NOTHING;

-- name: resume
WITH resumed AS (
    DELETE FROM {schema}.paused_queues WHERE queue = %(queue)s RETURNING queue
)
SELECT count(pg_notify(%(channel)s, queue)) FROM resumed;

-- name: stats_counts
SELECT queue, state, count(*) AS n FROM {schema}.jobs GROUP BY queue, state;

-- name: stats_oldest
WITH clock AS (SELECT {schema}.now_epoch(%(now)s) AS now)
SELECT j.queue, c.now - min(j.run_at) AS age
FROM {schema}.jobs AS j, clock AS c
WHERE j.state IN ('queued', 'scheduled') AND j.run_at <= c.now
GROUP BY j.queue, c.now;

-- name: paused_list
SELECT queue FROM {schema}.paused_queues;

-- name: jobs_depth
-- A scheduled job whose run_at has come is runnable: it counts as queued.
WITH clock AS (SELECT {schema}.now_epoch(%(now)s) AS now)
SELECT j.queue, j.task,
       CASE WHEN j.state = 'running' THEN 'running'
            WHEN j.run_at <= c.now THEN 'queued'
            ELSE 'scheduled' END AS depth_state,
       count(*) AS n
FROM {schema}.jobs AS j, clock AS c
WHERE j.state IN ('queued', 'scheduled', 'running')
GROUP BY j.queue, j.task, depth_state
ORDER BY j.queue, j.task, depth_state;

-- name: job_get
SELECT * FROM {schema}.jobs WHERE id = %(job_id)s;

-- name: jobs_list
-- Every column of a job but args, which a listing that does not show it whole asks cut
-- (%(args_limit)s characters; NULL: whole): a payload may be megabytes.
SELECT id, queue, task,
       CASE WHEN %(args_limit)s::integer IS NULL THEN args
            ELSE left(args, %(args_limit)s::integer) END AS args,
       idempotency_key, priority, run_at, attempt, max_attempts, state, lease_owner,
       lease_token, lease_expires_at, last_error, error_class, created_at, updated_at,
       finished_at, timeout, lease_expiries, max_lease_expiries
FROM {schema}.jobs
WHERE (%(state)s::text IS NULL OR state = %(state)s::text)
  AND (%(queue)s::text IS NULL OR queue = %(queue)s::text)
ORDER BY id DESC
LIMIT %(limit)s;

-- name: attempts_list
SELECT * FROM {schema}.attempts WHERE job_id = %(job_id)s ORDER BY token;

-- name: retry_dead
-- A fresh budget: attempt 0 of the job's own max_attempts; the attempts table keeps the
-- earlier ones, and the token is left for the next claim to bump.
WITH clock AS (SELECT {schema}.now_epoch(%(now)s) AS now),
revived AS (
    UPDATE {schema}.jobs AS j
    SET state = 'queued', attempt = 0, lease_expiries = 0, run_at = c.now,
        finished_at = NULL, updated_at = c.now
    FROM clock AS c
    WHERE j.id = ANY (%(ids)s::bigint[]) AND j.state = 'dead'
    RETURNING j.queue
),
notified AS (
    SELECT count(pg_notify(%(channel)s, q.queue)) AS n
    FROM (SELECT DISTINCT queue FROM revived) AS q
)
SELECT count(*) FROM revived, notified;

-- name: cancel
UPDATE {schema}.jobs
SET state = 'cancelled', last_error = %(reason)s, error_class = NULL,
    finished_at = {schema}.now_epoch(%(now)s), updated_at = {schema}.now_epoch(%(now)s)
WHERE id = ANY (%(ids)s::bigint[]) AND state IN ('queued', 'scheduled', 'dead');

-- name: stale_count
SELECT count(*) FROM {schema}.stale_commits;

-- name: stale_list
SELECT job_id, token, owner, operation, at FROM {schema}.stale_commits
ORDER BY id DESC
LIMIT %(limit)s;

-- name: worker_register
WITH clock AS (SELECT {schema}.now_epoch(%(now)s) AS now)
INSERT INTO {schema}.workers AS w (id, host, pid, queues, concurrency, state, token,
                                   started_at, heartbeat_at, expires_at, in_flight,
                                   concurrency_limit)
SELECT %(id)s, %(host)s, %(pid)s, %(queues)s::text[], %(concurrency)s, %(state)s, 1,
       c.now, c.now, c.now + %(ttl)s, 0, %(concurrency_limit)s::integer
FROM clock AS c
ON CONFLICT (id) DO UPDATE
SET token = w.token + 1,
    host = excluded.host,
    pid = excluded.pid,
    queues = excluded.queues,
    concurrency = excluded.concurrency,
    state = excluded.state,
    heartbeat_at = excluded.heartbeat_at,
    expires_at = excluded.expires_at,
    in_flight = 0,
    -- drain_requested kept: an operator's drain, asked before the process re-registered
    -- (fenced, or its membership lapsed while paused), still holds.
    concurrency_limit = excluded.concurrency_limit
RETURNING *;

-- name: worker_heartbeat
WITH clock AS (SELECT {schema}.now_epoch(%(now)s) AS now)
UPDATE {schema}.workers AS w
SET state = %(state)s, in_flight = %(in_flight)s, heartbeat_at = c.now,
    expires_at = c.now + %(ttl)s, clock_skew = COALESCE(%(skew)s, w.clock_skew),
    concurrency_limit = COALESCE(%(concurrency_limit)s::integer, w.concurrency_limit)
FROM clock AS c
WHERE w.id = %(id)s AND w.token = %(token)s AND w.expires_at > c.now
RETURNING w.*;

-- name: store_time
SELECT {schema}.now_epoch(%(now)s);

-- name: worker_deregister
WITH clock AS (SELECT {schema}.now_epoch(%(now)s) AS now)
UPDATE {schema}.workers AS w
SET state = 'stopped', in_flight = 0, heartbeat_at = c.now, expires_at = c.now
FROM clock AS c
WHERE w.id = %(id)s AND w.token = %(token)s;

-- name: workers_list
SELECT * FROM {schema}.workers ORDER BY started_at DESC;

-- name: worker_drain
-- Only a live membership: a stopped or expired worker would never read the request.
UPDATE {schema}.workers
SET drain_requested = true
WHERE id = %(id)s AND state <> 'stopped' AND expires_at > {schema}.now_epoch(%(now)s);

-- name: resource_lease_acquire
WITH clock AS (SELECT {schema}.now_epoch(%(now)s) AS now)
INSERT INTO {schema}.leases AS l (resource, owner, token, expires_at, acquired_at)
SELECT %(resource)s, %(owner)s, 1, c.now + %(ttl)s, c.now FROM clock AS c
ON CONFLICT (resource) DO UPDATE
SET token = CASE WHEN l.owner = excluded.owner
                      AND l.expires_at > {schema}.now_epoch(%(now)s)
                 THEN l.token ELSE l.token + 1 END,
    acquired_at = CASE WHEN l.owner = excluded.owner
                            AND l.expires_at > {schema}.now_epoch(%(now)s)
                       THEN l.acquired_at ELSE excluded.acquired_at END,
    owner = excluded.owner,
    expires_at = excluded.expires_at
WHERE l.expires_at <= {schema}.now_epoch(%(now)s) OR l.owner = excluded.owner
RETURNING resource, owner, token, expires_at;

-- name: resource_leases_list
-- Byte order, as the other stores sort: the database's collation would differ.
SELECT resource, owner, token, expires_at, acquired_at FROM {schema}.leases
ORDER BY resource COLLATE "C";

-- name: resource_lease_release
-- Expire rather than delete: the token counter must survive the release.
UPDATE {schema}.leases
SET expires_at = LEAST(expires_at, {schema}.now_epoch(%(now)s))
WHERE resource = %(resource)s AND owner = %(owner)s AND token = %(token)s;

-- name: leader_holds
-- Every maintenance write is fenced by the leader's term: inside the write's own
-- transaction, the maintenance lease must still be this owner's, with this token,
-- unexpired by the store's clock. FOR SHARE: a rival's acquire (an UPDATE of the row)
-- waits until this transaction ends, so no new term begins while it writes.
SELECT 1 FROM {schema}.leases
WHERE resource = %(resource)s AND owner = %(owner)s AND token = %(token)s
  AND expires_at > {schema}.now_epoch(%(now)s)
FOR SHARE;

-- name: prune_finished
-- One batch of succeeded and cancelled jobs; their attempts go by ON DELETE CASCADE,
-- their unique keys when they keep nothing out any more (a key held for good,
-- unique='always' without unique_for, stays). States are literals so that the partial
-- index jobs_finished serves every plan, prepared or not.
WITH picked AS (
    SELECT id, idempotency_key FROM {schema}.jobs
    WHERE state IN ('succeeded', 'cancelled') AND finished_at < %(before)s
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
),
keys AS (
    DELETE FROM {schema}.unique_keys AS k USING picked AS p
    WHERE k.key = p.idempotency_key AND k.job_id = p.id
      AND (k.while_active
           OR (k.held_until IS NOT NULL AND k.held_until <= {schema}.now_epoch(%(now)s)))
)
DELETE FROM {schema}.jobs AS j USING picked AS p WHERE j.id = p.id;

-- name: prune_dead
WITH picked AS (
    SELECT id, idempotency_key FROM {schema}.jobs
    WHERE state = 'dead' AND finished_at < %(before)s
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
),
keys AS (
    DELETE FROM {schema}.unique_keys AS k USING picked AS p
    WHERE k.key = p.idempotency_key AND k.job_id = p.id
      AND (k.while_active
           OR (k.held_until IS NOT NULL AND k.held_until <= {schema}.now_epoch(%(now)s)))
)
DELETE FROM {schema}.jobs AS j USING picked AS p WHERE j.id = p.id;

-- name: prune_finished_count
SELECT count(*) FROM {schema}.jobs
WHERE state IN ('succeeded', 'cancelled') AND finished_at < %(before)s;

-- name: prune_dead_count
SELECT count(*) FROM {schema}.jobs WHERE state = 'dead' AND finished_at < %(before)s;

-- name: prune_stale_commits
DELETE FROM {schema}.stale_commits
WHERE id IN (SELECT id FROM {schema}.stale_commits WHERE at < %(before)s
             ORDER BY id LIMIT %(limit)s);

-- name: prune_stale_commits_count
SELECT count(*) FROM {schema}.stale_commits WHERE at < %(before)s;

-- name: prune_duplicates
DELETE FROM {schema}.duplicates
WHERE id IN (SELECT id FROM {schema}.duplicates WHERE at < %(before)s LIMIT %(limit)s);

-- name: prune_duplicates_count
SELECT count(*) FROM {schema}.duplicates WHERE at < %(before)s;

-- name: schedule_advance
-- Moves the mark only forwards: no row comes back when it is already at or past the
-- instant, and then the caller enqueues nothing. The row lock of ON CONFLICT orders
-- two writers of one schedule; the second sees the first's mark.
WITH clock AS (SELECT {schema}.now_epoch(%(now)s) AS now)
INSERT INTO {schema}.schedules AS s (name, mark, updated_at)
SELECT %(name)s, %(instant)s, c.now FROM clock AS c
ON CONFLICT (name) DO UPDATE SET mark = excluded.mark, updated_at = excluded.updated_at
WHERE s.mark < excluded.mark  -- mark
RETURNING s.name;

-- name: schedule_marks
SELECT name, mark FROM {schema}.schedules ORDER BY name COLLATE "C";
-- name: reconcile_unacknowledged
-- Jobs whose fenced transaction committed (an attempt succeeded), still waiting or
-- running on a dead lease. Only the succeeded attempt proves the handler finished: an
-- effect of the job's own key completing proves that effect ran, not what came after
-- it (a retry, a crash), and acknowledging on it would skip the rest of the handler.
SELECT j.id, j.lease_token, j.state FROM {schema}.jobs AS j
WHERE j.state IN ('queued', 'scheduled', 'running')
  AND j.lease_token > 0  -- only a job that ran can have committed: not the backlog
  AND NOT (j.state = 'running' AND j.lease_expires_at > {schema}.now_epoch(%(now)s))
  AND EXISTS (SELECT 1 FROM {schema}.attempts AS a
              WHERE a.job_id = j.id AND a.outcome = 'succeeded')
ORDER BY j.id
LIMIT %(limit)s;

-- name: reconcile_pending_effects
-- Effect keys pending past the deadline whose attempt holds no live lease.
SELECT e.key, e.job_id, e.token, e.owner FROM {schema}.effects AS e
WHERE e.status = 'pending'
  AND e.updated_at <= {schema}.now_epoch(%(now)s) - %(deadline)s
  AND NOT EXISTS (
      SELECT 1 FROM {schema}.jobs AS j
      WHERE j.id = e.job_id AND j.state = 'running' AND j.lease_token = e.token
        AND j.lease_expires_at > {schema}.now_epoch(%(now)s))
ORDER BY e.key COLLATE "C"
LIMIT %(limit)s;

-- name: reconcile_orphan_leases
-- Resource leases still held by a worker whose membership is over: under its own id,
-- or by one of its job attempts through ctx.lease, whose owner is
-- '<worker id>/job<id>/t<token>' (worker/resources.py). The worker's id is compared
-- as an exact prefix, never as a pattern (an id may hold '/' or a LIKE wildcard); the
-- rest must be one 'job<digits>/t<digits>' pair, so that a worker whose id extends
-- another's ('w' and 'w/x') never answers for the other's leases. A holder that is not
-- a worker (a dedicated maintenance process, a user's own) is never judged.
SELECT r.resource, r.token, r.owner FROM {schema}.leases AS r
JOIN {schema}.workers AS w
  ON w.id = r.owner
  OR (left(r.owner, length(w.id) + 1) = w.id || '/'
      AND substr(r.owner, length(w.id) + 2) ~ '^job[0-9]+/t[0-9]+$')
WHERE r.expires_at > {schema}.now_epoch(%(now)s)
  AND (w.state = 'stopped' OR w.expires_at <= {schema}.now_epoch(%(now)s))
ORDER BY r.resource COLLATE "C"
LIMIT %(limit)s;

-- name: reconcile_open_attempts
-- Attempts without an outcome whose job is no longer running under their token.
SELECT a.job_id, a.token, a.owner FROM {schema}.attempts AS a
JOIN {schema}.jobs AS j ON j.id = a.job_id
WHERE a.finished_at IS NULL AND NOT (j.state = 'running' AND j.lease_token = a.token)
ORDER BY a.job_id, a.token
LIMIT %(limit)s;

-- name: repair_take
-- Queued never moves straight to succeeded: the reconciler takes the job first, with a
-- new token, so that no earlier holder matches any more. Only as it was seen.
UPDATE {schema}.jobs SET state = 'running', lease_token = lease_token + 1,
    lease_owner = NULL, updated_at = {schema}.now_epoch(%(now)s)
WHERE id = %(job_id)s AND lease_token = %(token)s AND state = %(state)s
  AND state IN ('queued', 'scheduled');

-- name: repair_acknowledge
-- Conditional on the token seen, and on no live lease for it.
UPDATE {schema}.jobs
SET state = 'succeeded', lease_owner = NULL, lease_expires_at = NULL,
    updated_at = {schema}.now_epoch(%(now)s), finished_at = {schema}.now_epoch(%(now)s)
WHERE id = %(job_id)s AND lease_token = %(token)s AND state = 'running'
  AND (lease_expires_at IS NULL OR lease_expires_at <= {schema}.now_epoch(%(now)s));

-- name: repair_attempt_close
-- Only an attempt whose job is no longer running under its token.
UPDATE {schema}.attempts
SET finished_at = {schema}.now_epoch(%(now)s), outcome = %(outcome)s, error = %(error)s,
    error_class = 'coordination'
WHERE job_id = %(job_id)s AND token = %(token)s AND finished_at IS NULL
  AND NOT EXISTS (SELECT 1 FROM {schema}.jobs AS j
                  WHERE j.id = %(job_id)s AND j.state = 'running'
                    AND j.lease_token = %(token)s);

-- name: repair_effect_fail
-- Only while still pending under the token seen, whose attempt holds no live lease.
UPDATE {schema}.effects
SET status = 'failed', error = %(error)s, updated_at = {schema}.now_epoch(%(now)s)
WHERE key = %(key)s AND status = 'pending' AND job_id = %(job_id)s AND token = %(token)s
  AND NOT EXISTS (
      SELECT 1 FROM {schema}.jobs AS j
      WHERE j.id = %(job_id)s AND j.state = 'running' AND j.lease_token = %(token)s
        AND j.lease_expires_at > {schema}.now_epoch(%(now)s));

-- name: resource_lease_expire
-- The reconciler's repair of an orphaned lease: a token bump, never a delete, so the
-- gone holder's (owner, token) matches nothing any more; only as it was seen.
UPDATE {schema}.leases
SET token = token + 1, expires_at = {schema}.now_epoch(%(now)s)
WHERE resource = %(key)s AND token = %(token)s AND owner = %(owner)s
  AND expires_at > {schema}.now_epoch(%(now)s);

-- name: schema_objects
-- Every object of the schema tokenline's checks look for (_catalog.py), as kind and
-- name: relations (tables, sequences, indexes), functions, triggers, constraints and
-- the tables' columns (as table.column).
WITH ns AS (SELECT oid FROM pg_catalog.pg_namespace WHERE nspname = %(schema)s)
SELECT CASE c.relkind WHEN 'S' THEN 'sequence' WHEN 'i' THEN 'index' ELSE 'table' END,
       c.relname
FROM pg_catalog.pg_class AS c, ns
WHERE c.relnamespace = ns.oid AND c.relkind IN ('r', 'p', 'S', 'i')
UNION ALL
SELECT 'function', p.proname FROM pg_catalog.pg_proc AS p, ns WHERE p.pronamespace = ns.oid
UNION ALL
SELECT 'trigger', t.tgname
FROM pg_catalog.pg_trigger AS t
     JOIN pg_catalog.pg_class AS c ON c.oid = t.tgrelid, ns
WHERE c.relnamespace = ns.oid AND NOT t.tgisinternal
UNION ALL
SELECT 'constraint', k.conname
FROM pg_catalog.pg_constraint AS k, ns
WHERE k.connamespace = ns.oid
UNION ALL
SELECT 'column', c.relname || '.' || a.attname
FROM pg_catalog.pg_attribute AS a
     JOIN pg_catalog.pg_class AS c ON c.oid = a.attrelid, ns
WHERE c.relnamespace = ns.oid AND c.relkind IN ('r', 'p') AND a.attnum > 0
  AND NOT a.attisdropped;
