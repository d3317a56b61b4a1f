"""``python -m nanbisect``: the command line, with the working directory off ``sys.path``.

``python -m`` puts the working directory first on ``sys.path``, so ``nanbisect inspect .`` in a
bundle directory would import a ``typer.py``, ``json.py`` or ``torch.py`` shipped in the bundle
instead of the real one: running code from a bundle that `inspect` promises never to run. It is
taken off here, before any dependency is imported (the package's ``__init__`` imports only what
``python -m`` itself has loaded); a dotted ``--entry pkg.module:func`` is resolved against the
working directory explicitly (`nanbisect.task.import_target`), as for the ``nanbisect`` command,
whose ``sys.path`` never held it. A directory also named by ``PYTHONPATH`` stays.
"""
import os
import sys


def _drop_working_directory() -> None:
    if getattr(sys.flags, "safe_path", False) or not sys.path:   # -P (3.11): nothing put there
        return
    try:
        cwd = os.getcwd()
    except OSError:     # the working directory was deleted: nothing can be imported from it
        cwd = None
    if sys.path[0] in ("", cwd) and sys.path[0] not in sys.path[1:]:
        del sys.path[0]


_drop_working_directory()

from nanbisect.cli import main  # noqa: E402 - only now: see the module docstring

main()
