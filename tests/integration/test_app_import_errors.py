"""``--app mod:app`` whose module raises while it is imported: one line naming the
module, the error and where in the user's code it was raised, exit status 2, never a
traceback."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
from click.testing import CliRunner

from tokenline.cli import main


@pytest.fixture
def module_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _module(where: Path, source: str) -> str:
    name = f"app_import_{uuid.uuid4().hex[:8]}"
    (where / f"{name}.py").write_text(source)
    return name


def _queues(where: Path, module: str) -> tuple[int, str]:
    result = CliRunner().invoke(
        main,
        ["queues", "--app", f"{module}:app", "--url", f"sqlite:///{where / 'q.db'}"],
        terminal_width=400,
        catch_exceptions=False,
    )
    return result.exit_code, " ".join(result.output.split())


def test_a_module_that_raises_on_import_is_named_with_the_line(module_dir: Path) -> None:
    """os.environ["MISSING"] at import time ended in a KeyError traceback through
    load_app; the line named is the user's, not os.py's where the KeyError is raised."""
    module = _module(
        module_dir, 'import os\n\nfrom tokenline import App\n\nURL = os.environ["MISSING"]\n'
    )
    code, out = _queues(module_dir, module)
    assert code == 2, out
    assert f"importing {module!r} failed: KeyError: 'MISSING'" in out
    assert f"(at {module_dir / (module + '.py')}, line 5)" in out
    assert "Traceback" not in out
    assert list(module_dir.glob("q.db*")) == []


def test_the_line_is_in_the_users_module_that_raised(module_dir: Path) -> None:
    """An error raised in a module the app's module imports names that module's line."""
    helper = _module(module_dir, "x = 1\nraise RuntimeError('no config')\n")
    module = _module(module_dir, f"import {helper}\n")
    code, out = _queues(module_dir, module)
    assert code == 2, out
    assert f"importing {module!r} failed: RuntimeError: no config" in out
    assert f"(at {module_dir / (helper + '.py')}, line 2)" in out


@pytest.mark.parametrize(
    ("source", "said", "line"),
    [
        ("import nosuchdependency_x\n", "ModuleNotFoundError: No module named", 1),
        ("\nfrom os import nosuchname\n", "ImportError: cannot import name 'nosuchname'", 2),
        ("x = 1\ndef f(:\n", "SyntaxError: ", 2),
        ("x = 1\nraise ValueError\n", "failed: ValueError (at", 2),
    ],
)
def test_each_kind_of_error_is_named(module_dir: Path, source: str, said: str, line: int) -> None:
    """An ImportError raised by the module's own imports said "cannot import 'mod'", as if
    the module itself were missing, and named no line."""
    module = _module(module_dir, source)
    code, out = _queues(module_dir, module)
    assert code == 2, out
    assert f"importing {module!r} failed: " in out
    assert said in out
    assert f"{module_dir / (module + '.py')}, line {line})" in out


def test_a_missing_module_is_still_said_to_be_missing(module_dir: Path) -> None:
    code, out = _queues(module_dir, "nosuchmodule_x")
    assert code == 2, out
    assert "cannot import 'nosuchmodule_x': No module named 'nosuchmodule_x'" in out


@pytest.mark.parametrize(
    ("source", "said", "line"),
    [
        (
            "from tokenline import App\n\napp = App()\n\n"
            "@app.task(name='a', queue='bad queue')\ndef a(ctx):\n    pass\n",
            "QueueNameError: invalid queue name 'bad queue'",
            5,
        ),
        (
            "from tokenline import App\n\napp = App()\napp.task(name='a')(lambda ctx: None)\n"
            "app.task(name='a')(lambda ctx: None)\n",
            "failed: ",
            5,
        ),
    ],
)
def test_an_error_of_tokenlines_own_checks_names_the_users_line(
    module_dir: Path, source: str, said: str, line: int
) -> None:
    """An error raised by tokenline's checks of the app (a bad queue name, a task
    registered twice) named tokenline's line that raised it (_config.py, line 95) when
    tokenline ran from a source checkout: the user's line that called it is named."""
    module = _module(module_dir, source)
    code, out = _queues(module_dir, module)
    assert code == 2, out
    assert said in out
    assert f"(at {module_dir / (module + '.py')}, line {line})" in out


def test_an_error_all_inside_tokenline_names_its_innermost_line() -> None:
    """With no frame outside tokenline (a module of tokenline's own given to --app),
    the line that raised is named."""
    import os

    from tokenline.cli._common import _PACKAGE, _where_raised

    inner = os.path.join(_PACKAGE, "no_such_module_for_the_test.py")
    code = compile("def f():\n    raise LookupError('x')\n\n\nf()\n", inner, "exec")
    with pytest.raises(LookupError, match="x") as raised:
        exec(code, {})
    # As an import's error starts: in the module's own frame, not this test's.
    tb = raised.value.__traceback__
    assert tb is not None
    error = raised.value.with_traceback(tb.tb_next)
    assert _where_raised(error) == f"{inner}, line 2"
