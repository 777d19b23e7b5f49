"""Who may act, and from where: the operator token, the CSRF token, the origin check.

Reading needs nothing; every action is a POST that must pass, in this order:

1. **same origin**: a browser's ``Sec-Fetch-Site`` must say ``same-origin`` (or
   ``none``: typed by the user), and an ``Origin`` header, when sent, must be this
   dashboard's own, as its configuration says (:mod:`.hosts`), never as the request's
   ``Host`` says. A page on another site cannot make the browser act here.
2. **CSRF token**: the form carries the token this process put in it (fresh at every
   start, never in a cookie), so a forged form that passed step 1 still fails.
3. **actions enabled**: a dashboard started without ``TOKENLINE_DASHBOARD_TOKEN`` is
   read-only.
4. **operator token**: the form's ``operator_token`` field (or ``Authorization: Bearer …``)
   equals ``TOKENLINE_DASHBOARD_TOKEN``.

Tokens are compared with :func:`hmac.compare_digest`, in time independent of where they
differ.
"""

from __future__ import annotations

import hmac
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = ["MIN_TOKEN_LENGTH", "Guard", "Refusal", "check_operator_token"]

#: The shortest operator token accepted: a guessable secret is no secret.
MIN_TOKEN_LENGTH = 16

#: ``Sec-Fetch-Site`` values a browser sends for a request this dashboard may act on.
_SAME_SITE = frozenset({"same-origin", "none"})


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why an action is refused: the HTTP status and a sentence for the operator."""

    status: int
    title: str
    why: str


def check_operator_token(token: str, *, name: str = "the operator token") -> str:
    """``token`` when it can serve as the operator token, else :class:`ValueError`
    saying why: empty or blank (a secret that failed to load must not enable actions,
    nor silently leave them off), padded with whitespace (nobody would type it), or
    shorter than :data:`MIN_TOKEN_LENGTH`."""
    if not token.strip():
        raise ValueError(
            f"{name} is set but blank: set it to a secret of at least {MIN_TOKEN_LENGTH} "
            "characters to enable actions, or leave it unset for a read-only dashboard"
        )
    if token != token.strip():
        raise ValueError(f"{name} starts or ends with whitespace: remove it")
    if not all("!" <= c <= "~" for c in token):
        # Sent as `Authorization: Bearer …` it must be plain ASCII (a header is read as
        # Latin-1), and typed into a password field it cannot hold a line break.
        raise ValueError(
            f"{name} holds a space, a control character or a character outside ASCII: "
            "use printable ASCII only (e.g. python -c 'import secrets; "
            "print(secrets.token_urlsafe())')"
        )
    if len(token) < MIN_TOKEN_LENGTH:
        raise ValueError(
            f"{name} is {len(token)} characters long: use a secret of at least "
            f"{MIN_TOKEN_LENGTH} (e.g. python -c 'import secrets; print(secrets.token_urlsafe())')"
        )
    return token


def _same(a: str, b: str) -> bool:
    return hmac.compare_digest(a.encode(), b.encode())


@dataclass(frozen=True, slots=True)
class Guard:
    """The checks of an action request; ``operator_token`` ``None``: read-only."""

    operator_token: str | None
    csrf_token: str = field(default_factory=lambda: secrets.token_urlsafe(32))

    @property
    def read_only(self) -> bool:
        """Whether actions are disabled (no operator token configured)."""
        return not self.operator_token

    def check_origin(
        self,
        *,
        origin: str | None,
        fetch_site: str | None,
        is_own: Callable[[str], bool],
        own_origin: str,
    ) -> Refusal | None:
        """Refuse a request a browser sent from another site: ``is_own`` tells whether
        an origin is this dashboard's, ``own_origin`` names it in the refusal."""
        if fetch_site is not None and fetch_site.lower() not in _SAME_SITE:
            return Refusal(
                403,
                "Cross-site request refused",
                f"the browser says it came from a {fetch_site} page",
            )
        if origin is not None and not is_own(origin):
            return Refusal(
                403,
                "Cross-site request refused",
                f"it came from {origin!r}, not from this dashboard ({own_origin})",
            )
        return None

    def check_csrf(self, presented: str | None) -> Refusal | None:
        """Refuse a form this process did not issue (forged, or from before a restart)."""
        if presented and _same(presented, self.csrf_token):
            return None
        return Refusal(
            403,
            "Form refused",
            "the form's CSRF token is missing or not this dashboard's (forged, or issued "
            "before the dashboard restarted): open the page again and repeat the action",
        )

    def check_operator(self, presented: str | None) -> Refusal | None:
        """Refuse when actions are disabled, or the operator token is missing or wrong."""
        if self.operator_token is None or not self.operator_token:
            return Refusal(
                403,
                "Actions are disabled",
                "this dashboard is read-only: start it with TOKENLINE_DASHBOARD_TOKEN set "
                "to a secret to enable actions, and give that secret with each action",
            )
        if not presented:
            return Refusal(401, "Operator token required", "no operator token was given")
        if not _same(presented, self.operator_token):
            return Refusal(401, "Operator token refused", "the operator token is wrong")
        return None
