"""The template's worker module for a user's Python command (`checkpointless-run script.py`, `-m module`, a recipe's
`script=`): every rank and spare of such a job is forked from one process that imported torch and Lightning once.

A rank started as a new interpreter spends most of its start-up importing: measured on 2 cores, `import
lightning.pytorch` alone takes 11 s of CPU (torch 5 s of it, torch._dynamo 4 s), and a job of 4 ranks and a spare
took 35 s to run 2 steps, 25 s of it importing the same modules five times over. Forked from the template, a rank
starts with them imported (pages shared copy-on-write) and runs only the script.

`spare_template()` imports `PRELOAD` and returns `run_command`, which a forked process runs: the interpreter's
arguments come in `ARGV_ENV` (JSON), as the launcher would have exec'd them after `python`:
`-u SCRIPT ARGS`, `-u -m MODULE ARGS` or `-u -c CODE ARGS`. It sets `sys.argv`, `sys.path[0]` and `__main__` as the
interpreter does, reseeds what a new interpreter seeds from the OS (`random`, numpy's and torch's default
generators), runs the command, and exits as the interpreter would: `SystemExit`'s code, a traceback and 1 for an
uncaught exception, after joining the script's non-daemon threads and running its `atexit` functions.
"""

from __future__ import annotations

import atexit
import builtins
import contextlib
import importlib
import json
import os
import random
import runpy
import signal
import sys
import threading
import types
from collections.abc import Callable, Sequence

from nemo_checkpointless.restart import kin

ARGV_ENV = "NCL_PYTHON_ARGV"
# The template's imports, in order: the job's `launcher.preload` modules (each `install()`ed, as a worker does
# before NeMo is imported), then `PRELOAD`, then the engine's own (NeMo's for engine=nemo). A module that is not
# installed is skipped.
INSTALL_ENV = "NCL_TEMPLATE_INSTALL"
IMPORT_ENV = "NCL_TEMPLATE_IMPORT"
PRELOAD = ("torch", "torch.distributed", "lightning.pytorch", "nemo_checkpointless.lightning")
ENGINE_IMPORTS = {"lightning": (), "nemo": ("megatron.core", "nemo.lightning", "nemo.collections.llm")}


def template_env(install: Sequence[str], engine: str) -> dict[str, str]:
    """The variables that tell the template what to import before it forks."""
    return {INSTALL_ENV: ",".join(install), IMPORT_ENV: ",".join(ENGINE_IMPORTS.get(engine, ()))}


def forkable(command: Sequence[str]) -> bool:
    """Whether the template can run `command` (this interpreter, unbuffered, then a script, -m or -c)."""
    return len(command) >= 3 and command[0] == sys.executable and command[1] == "-u" and (
        command[2] not in ("-m", "-c") or len(command) >= 4)


# The `launcher.preload` modules the template imported and installed: the preload bootstrap and a worker's
# `preload` skip them in a forked process (`already_installed`).
INSTALLED: set[str] = set()


def already_installed(name: str) -> bool:
    return name in INSTALLED


def spare_template() -> Callable[[], None]:
    # A fork is unusable for CUDA once the parent initialised the driver: an import that asks whether CUDA is
    # available asks NVML instead (PyTorch's switch for this), and a template that initialised CUDA anyway says so
    # (the launcher then starts the ranks as new interpreters).
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    for name in filter(None, os.environ.pop(INSTALL_ENV, "").split(",")):
        install = getattr(importlib.import_module(name), "install", None)
        if callable(install):
            install()
        INSTALLED.add(name)
    for name in (*PRELOAD, *filter(None, os.environ.pop(IMPORT_ENV, "").split(","))):
        with contextlib.suppress(ImportError):
            importlib.import_module(name)
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        raise RuntimeError("CUDA was initialised by an import; a forked process could not use it")
    return run_command


def run_command() -> None:
    """In a forked process: run the command in `ARGV_ENV` as `python` would, then exit (never returns)."""
    argv = json.loads(os.environ.pop(ARGV_ENV))[1:]  # after "-u"
    kin.register_forked()  # who this process is, for `procs.rank_pids` (its /proc environ is the template's)
    sys.stdin = open(os.devnull)  # noqa: SIM115  (the template's stdin buffer holds the launcher's requests)
    random.seed()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.seed()  # a new interpreter's default generator starts from a non-deterministic seed
    interrupted = False
    try:
        _run(argv)
        code = 0
    except SystemExit as e:
        code = _exit_code(e.code)
    except KeyboardInterrupt:
        sys.excepthook(*sys.exc_info())
        code, interrupted = 1, True
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    code = _finalize(code)
    if interrupted:  # as the interpreter does: die by SIGINT
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(code)


def _run(argv: list[str]) -> None:
    if argv[0] == "-m":
        sys.argv = argv[1:]
        sys.path[0] = os.getcwd()
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    elif argv[0] == "-c":
        sys.argv = ["-c", *argv[2:]]
        sys.path[0] = ""
        main = types.ModuleType("__main__")
        main.__dict__["__builtins__"] = builtins
        sys.modules["__main__"] = main
        exec(compile(argv[1], "<string>", "exec"), main.__dict__)
    else:
        sys.argv = list(argv)
        sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
        runpy.run_path(argv[0], run_name="__main__")


def _exit_code(code: object) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def _finalize(code: int) -> int:
    """What the interpreter does at exit, in its order: `threading`'s own exit hooks (`threading._shutdown`: a
    `concurrent.futures` pool's hook wakes its idle workers so that they end), then wait for non-daemon threads,
    run `atexit` functions, flush. Joining the threads without those hooks first waited forever for a pool's idle
    worker (a NeMo rank whose script had finished hung so, holding the job's end)."""
    try:
        shutdown = getattr(threading, "_shutdown", None)  # what Python's finalisation calls (3.11 to 3.13)
        if callable(shutdown):
            shutdown()  # the hooks, then the join of every non-daemon thread
        else:
            for thread in threading.enumerate():
                if thread is not threading.current_thread() and not thread.daemon:
                    thread.join()
        atexit._run_exitfuncs()
    except SystemExit as e:
        code = _exit_code(e.code)
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = code or 1
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    return code
