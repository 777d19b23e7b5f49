"""redis-py errors, translated into tokenline's tree in one place.

A connection that fails or times out is :class:`StoreUnavailableError` (coordination:
the worker drains, nothing is lost); a script Redis refuses is :class:`StoreError`,
naming the script. Nothing else of redis-py reaches a caller.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from redis import exceptions as rx

from ..._errors import StoreError, StoreUnavailableError, TokenlineError, from_server
from ._url import TLS_MARK

__all__ = ["map_redis_errors", "maybe_sent"]


@contextlib.contextmanager
def map_redis_errors(where: str, operation: str) -> Iterator[None]:
    """Translate redis-py and timeout errors raised inside into tokenline's tree, each
    marked as Redis's (``StoreError.server``); ``where`` names the server (no
    password), ``operation`` the script or command."""
    with from_server("Redis"), _translated(where, operation):
        yield


@contextlib.contextmanager
def _translated(where: str, operation: str) -> Iterator[None]:
    try:
        yield
    except TokenlineError:
        raise
    except rx.AuthenticationError as exc:
        raise StoreUnavailableError(
            f"Redis at {where} refused the credentials in the URL: {exc}"
        ) from exc
    except (rx.ConnectionError, rx.TimeoutError, rx.BusyLoadingError) as exc:
        # A server without TLS, asked for it, never answers the handshake: a timeout.
        tls = ", with TLS on (the URL is rediss://)," if where.endswith(TLS_MARK) else ""
        raise StoreUnavailableError(
            f"cannot reach Redis at {where} ({operation}): is the server running{tls} and "
            f"are the host and port in the URL right? ({exc})"
        ) from exc
    except rx.ReadOnlyError as exc:
        # A replica, or a primary demoted by a failover: writes must go elsewhere.
        raise StoreUnavailableError(
            f"Redis at {where} is read-only ({operation}): it is a replica; point the URL "
            f"at the primary ({exc})"
        ) from exc
    except rx.RedisError as exc:
        raise StoreError(f"Redis at {where} refused {operation}: {exc}") from exc
    except TimeoutError as exc:
        raise StoreUnavailableError(
            f"Redis at {where} did not answer {operation} within the store timeout"
        ) from exc
    except OSError as exc:
        raise StoreUnavailableError(f"cannot reach Redis at {where} ({operation}): {exc}") from exc


def _connecting(exc: BaseException) -> bool:
    """Whether redis-py raised ``exc`` while it made the connection, before any request
    went out: its messages say "Error N connecting to …" and "Timeout connecting to
    server"."""
    return "connecting to" in str(exc).lower()


def maybe_sent(exc: StoreUnavailableError) -> bool:
    """Whether the request that failed with ``exc`` may have reached Redis and been
    carried out: not when the connection could not be made, nor when Redis refused it
    (credentials, a read-only replica, a data set still loading)."""
    cause = exc.__cause__
    if isinstance(cause, rx.AuthenticationError | rx.ReadOnlyError | rx.BusyLoadingError):
        return False
    return not (isinstance(cause, rx.ConnectionError | rx.TimeoutError) and _connecting(cause))
