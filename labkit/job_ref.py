"""How a job reaches the ranks by name: ``(module, qualname)`` for a job function or a
``'module:function'`` string, refused in the caller when a fresh interpreter could not
import it (a notebook cell, a lambda, a nested function); resolved on a rank, reloading a
job file edited since; and the job's config checked against its annotation before launch.
"""
from __future__ import annotations

import importlib
import os
import sys
from typing import Any, Callable, Union


_LOADED: dict = {}  # module name -> source mtime when this rank imported it


def resolve_job(module: str, qualname: str, reload_changed: bool = False):
    """Import ``module`` and walk ``qualname`` to the job function.

    With ``reload_changed`` (what ranks use), a module whose source file changed since this
    process imported it is reloaded, so editing a job file next to the notebook takes effect
    on the warm ranks without a restart. Only the job's own module is reloaded, not the
    modules it imports.
    """
    obj = importlib.import_module(module)
    if reload_changed:
        path = getattr(obj, "__file__", None)
        mtime = os.path.getmtime(path) if path and os.path.exists(path) else None
        if module in _LOADED and mtime is not None and mtime != _LOADED[module]:
            obj = importlib.reload(obj)
        _LOADED[module] = mtime
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def job_reference(job: Union[Callable, str]) -> tuple[str, str]:
    """``(module, qualname)`` by which a fresh rank process can import ``job``.

    Raises:
        TypeError: the function lives in ``__main__`` (a notebook cell or a script run
            directly), is nested or a lambda, or cannot be re-imported by name.
    """
    if isinstance(job, str):
        module, _, qualname = job.partition(":")
        if not qualname:
            raise TypeError(f"job string {job!r} must look like 'package.module:function'")
        return module, qualname
    module = getattr(job, "__module__", None)
    qualname = getattr(job, "__qualname__", None) or getattr(job, "__name__", "?")
    name = getattr(job, "__name__", repr(job))
    import_as = name  # what the advice tells the user to import
    why = None
    if not callable(job):
        raise TypeError(f"job must be a function or 'module:function', got {type(job).__name__}")
    if module in (None, "__main__", "__mp_main__"):
        why = (f"it was defined in {'a notebook cell' if 'ipykernel' in sys.modules else '__main__'}"
               " (module '__main__')")
    elif "<lambda>" in qualname:
        why = "it is a lambda, which has no name the ranks could import"
        import_as = "my_job"
    elif "<locals>" in qualname:
        why = "it is a nested function"
    else:
        try:
            if resolve_job(module, qualname) is not job:
                why = f"{module}.{qualname} names a different object"
        except Exception as exc:  # noqa: BLE001 - any import failure means "not importable"
            why = f"importing {module}.{qualname} failed ({type(exc).__name__}: {exc})"
    if why:
        raise TypeError(
            f"job {name!r} cannot run on the cluster: {why}. Rank processes are fresh Python "
            f"interpreters that import a job by module and name, so the job must live in an "
            f"importable file. Move it to a .py file next to the notebook (e.g. my_jobs.py), "
            f"then `from my_jobs import {import_as}` and pass that; or use a job from "
            f"labkit.jobs.")
    return module, qualname


def check_config(job: Union[Callable, str], config: Any) -> None:
    """Refuse, in the caller, a config that is not of the class the job's second parameter
    is annotated with (``train(ctx, cfg: RunConfig)``), so the mistake is named before any
    rank starts instead of surfacing as a traceback from every rank.

    Raises:
        TypeError: naming the job, the expected class and what was passed.
    """
    import inspect
    import typing

    if isinstance(config, type):
        raise TypeError(f"config must be an instance, got the class {config.__name__}; "
                        f"write {config.__name__}(...)")
    fn = resolve_job(*job_reference(job)) if isinstance(job, str) else job
    try:
        params = list(inspect.signature(fn).parameters.values())
        hints = typing.get_type_hints(fn)
    except Exception:  # noqa: BLE001 - unresolvable annotations: nothing to check
        return
    if len(params) < 2:
        return
    want = hints.get(params[1].name)
    if isinstance(want, type) and want is not object and not isinstance(config, want):
        raise TypeError(f"job {fn.__module__}.{fn.__qualname__} takes a {want.__name__} as "
                        f"its config, got {type(config).__name__} ({config!r:.80})")
