-- tokenline: the SQLite store's coordination file (``<store>-coord``), attached to every
-- connection as ``coord``. It holds what changes on every renewal tick — job lease
-- expiries, worker membership, resource lease holders — and the clock anchor, so that
-- renewals take this file's write lock, never the main file's: a transaction left open
-- by a handler in the main file (ctx.transaction()) cannot hold up any renewal.
--
-- Nothing here decides ownership of a job: the job's token in the main file does, and
-- every commit is checked against it there. This file says only whether a lease is
-- still alive, by the store's clock. Safety argument in store.py.

-- name: schema
CREATE TABLE IF NOT EXISTS coord.clock (
    id      INTEGER PRIMARY KEY CHECK (id = 1),
    boot_id TEXT    NOT NULL,
    wall    REAL    NOT NULL,
    uptime  REAL    NOT NULL
);
CREATE TABLE IF NOT EXISTS coord.job_leases (
    job_id     INTEGER PRIMARY KEY,
    token      INTEGER NOT NULL,
    owner      TEXT    NOT NULL,
    expires_at REAL    NOT NULL
);
CREATE INDEX IF NOT EXISTS coord.job_leases_expiry ON job_leases (expires_at);
CREATE TABLE IF NOT EXISTS coord.workers (
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
    in_flight    INTEGER NOT NULL DEFAULT 0,
    clock_skew   REAL
);
CREATE TABLE IF NOT EXISTS coord.resource_leases (
    resource   TEXT PRIMARY KEY,
    owner      TEXT    NOT NULL,
    token      INTEGER NOT NULL,
    expires_at REAL    NOT NULL
);

-- name: schema_v2
-- An operator's request that a worker drain (tokenline drain), read at its heartbeat.
ALTER TABLE coord.workers ADD COLUMN drain_requested INTEGER NOT NULL DEFAULT 0;

-- name: schema_v3
-- When each resource lease's current token was issued (NULL: before it was recorded).
ALTER TABLE coord.resource_leases ADD COLUMN acquired_at REAL;

-- name: schema_v4
-- Each worker's adaptive concurrency limit, as its heartbeat last reported it (NULL:
-- not reported yet).
ALTER TABLE coord.workers ADD COLUMN concurrency_limit INTEGER;

-- name: clock_get
SELECT boot_id, wall, uptime FROM coord.clock WHERE id = 1;

-- name: clock_set
INSERT INTO coord.clock (id, boot_id, wall, uptime) VALUES (1, :boot_id, :wall, :uptime)
ON CONFLICT (id) DO UPDATE
SET boot_id = excluded.boot_id, wall = excluded.wall, uptime = excluded.uptime;

-- name: reboot_job_leases
-- A new boot: every lease of the last one is over (its holders are gone).
DELETE FROM coord.job_leases;

-- name: reboot_workers
UPDATE coord.workers SET expires_at = 0;

-- name: reboot_resource_leases
-- Expired, not deleted: the holder and token stay for the record.
UPDATE coord.resource_leases SET expires_at = 0;

-- name: job_leases_grant
-- Written, and committed, before the claim commits in the main file: whoever sees a job
-- running there also sees its lease here. A row gives way only to an equal or higher
-- token (equal: a claim that never committed in the main file, taken again).
INSERT INTO coord.job_leases (job_id, token, owner, expires_at)
SELECT json_extract(value, '$[0]'), json_extract(value, '$[1]'), :owner, :now + :ttl
FROM json_each(:leases) WHERE true
ON CONFLICT (job_id) DO UPDATE
SET token = excluded.token, owner = excluded.owner, expires_at = excluded.expires_at
WHERE excluded.token >= job_leases.token;

-- name: job_leases_renew
-- An expired lease is never renewed: once the store's clock has passed it, it stays
-- passed, and the rescuer may act on it.
UPDATE coord.job_leases SET expires_at = :now + :ttl
FROM (SELECT json_extract(value, '$[0]') AS jid, json_extract(value, '$[1]') AS tok
      FROM json_each(:leases)) AS held
WHERE job_leases.job_id = held.jid
  AND job_leases.token = held.tok  -- fence
  AND job_leases.owner = :owner  -- fence
  AND job_leases.expires_at > :now
RETURNING job_id, expires_at;

-- name: job_lease_holders
SELECT job_id, token, owner FROM coord.job_leases
WHERE job_id IN (SELECT value FROM json_each(:ids));

-- name: job_leases_prune
-- Rows of finished or rescued attempts, long expired. A running job whose row is gone
-- counts as expired, which it was.
DELETE FROM coord.job_leases WHERE expires_at <= :before;

-- name: worker_register
INSERT INTO coord.workers (id, host, pid, queues, concurrency, state, token,
                           started_at, heartbeat_at, expires_at, in_flight,
                           concurrency_limit)
VALUES (:id, :host, :pid, :queues, :concurrency, :state, 1, :now, :now, :now + :ttl, 0,
        :concurrency_limit)
-- drain_requested kept on a re-registration: an operator's drain, asked before the
-- process re-registered (fenced, or its membership lapsed while paused), still holds.
ON CONFLICT (id) DO UPDATE
SET token = workers.token + 1, state = excluded.state,
    heartbeat_at = excluded.heartbeat_at, expires_at = excluded.expires_at, in_flight = 0,
    concurrency_limit = excluded.concurrency_limit
RETURNING *;

-- name: worker_heartbeat
UPDATE coord.workers
SET state = :state, in_flight = :in_flight, heartbeat_at = :now, expires_at = :now + :ttl,
    clock_skew = COALESCE(:skew, clock_skew),
    concurrency_limit = COALESCE(:concurrency_limit, concurrency_limit)
WHERE id = :id AND token = :token AND expires_at > :now
RETURNING *;

-- name: worker_deregister
UPDATE coord.workers
SET state = 'stopped', in_flight = 0, heartbeat_at = :now, expires_at = :now
WHERE id = :id AND token = :token;

-- name: workers_list
SELECT * FROM coord.workers ORDER BY started_at DESC;

-- name: worker_drain
-- Only a live membership: a stopped or expired worker would never read the request.
UPDATE coord.workers SET drain_requested = 1
WHERE id = :id AND state != 'stopped' AND expires_at > :now;

-- name: resource_lease_get
SELECT resource, owner, token, expires_at FROM coord.resource_leases
WHERE resource = :resource;

-- name: resource_lease_extend
-- The holder's renewal: owner, and the token when one is given, must match, unexpired.
UPDATE coord.resource_leases SET expires_at = :now + :ttl
WHERE resource = :resource AND owner = :owner AND expires_at > :now
  AND (:token IS NULL OR token = :token)
RETURNING resource, owner, token, expires_at;

-- name: resource_lease_take
-- A new holder with a new token, only if the lease is free or expired (checked again
-- here, under this file's write lock).
INSERT INTO coord.resource_leases (resource, owner, token, expires_at, acquired_at)
VALUES (:resource, :owner, :token, :now + :ttl, :now)
ON CONFLICT (resource) DO UPDATE
SET owner = excluded.owner, token = excluded.token, expires_at = excluded.expires_at,
    acquired_at = excluded.acquired_at
WHERE resource_leases.expires_at <= :now
RETURNING resource, owner, token, expires_at;

-- name: resource_lease_release
-- Expire rather than delete: the holder and token stay for the record.
UPDATE coord.resource_leases SET expires_at = :now
WHERE resource = :resource AND owner = :owner AND token = :token AND expires_at > :now;

-- name: resource_leases_list
SELECT resource, owner, token, expires_at, acquired_at FROM coord.resource_leases
ORDER BY resource;

-- name: resource_lease_held
SELECT 1 FROM coord.resource_leases
WHERE resource = :resource AND owner = :owner AND token = :token AND expires_at > :now;

-- name: resource_lease_expire
-- The reconciler's repair of an orphaned lease: a token bump, never a delete, so the
-- gone holder's (owner, token) matches nothing any more; only as it was seen.
UPDATE coord.resource_leases SET token = token + 1, expires_at = :now
WHERE resource = :key AND token = :token AND owner = :owner AND expires_at > :now;
