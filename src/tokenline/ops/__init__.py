"""Operations files shipped with tokenline.

``alerts.rules.yml`` holds Prometheus alerting rules (group ``tokenline``) over the
metrics of the workers (``tokenline worker --metrics-port``) and of the store-wide
exporter (``tokenline exporter``). Each alert's ``runbook_url`` names its section of
``docs/runbook.md``. Copy the file next to your Prometheus configuration and list it in
``rule_files``; this prints where it is installed::

    python -c 'import tokenline.ops; print(tokenline.ops.alert_rules_path())'
"""

from __future__ import annotations

import pathlib
from importlib import resources

__all__ = ["ALERT_RULES", "alert_rules_path"]

#: The rules file's name inside this package.
ALERT_RULES = "alerts.rules.yml"


def alert_rules_path() -> pathlib.Path:
    """The path of the installed Prometheus alerting rules file."""
    path = resources.files(__name__).joinpath(ALERT_RULES)
    # Installed as a regular package (or in editable mode), so the resource is a file.
    return pathlib.Path(str(path))
