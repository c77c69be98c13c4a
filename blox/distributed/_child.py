"""The runner `launch` starts each process through: ``python -u _child.py SCRIPT ARGS`` (or
``-m MODULE ARGS``). It runs the script as ``__main__`` (as ``python SCRIPT`` does) and
tells the launcher the exit status before the interpreter finalizes, so that a process
ending with ``sys.exit(3)`` or an exception is known at once, even while JAX's exit
handler makes it wait for its peers at the shutdown barrier.

It is run as a file, never imported through the ``blox`` package: it must not import JAX
before the script does (a script may set ``JAX_PLATFORMS`` first). It reads
``BLOX_LAUNCH_DIR`` (where it writes ``exit.<rank>``), ``BLOX_PROCESS_ID`` and
``BLOX_LAUNCHER_PID``.
"""

import ctypes
import os
import runpy
import signal
import sys

_PR_SET_PDEATHSIG = 1
_HIDDEN = (os.path.abspath(__file__), os.path.abspath(runpy.__file__), "<frozen runpy>")


def _die_with_launcher() -> None:
    """Linux: SIGKILL this process when the launcher dies (even by SIGKILL), set here
    after ``exec`` rather than in a ``preexec_fn`` (unsafe in a threaded launcher)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        return
    launcher = os.environ.get("BLOX_LAUNCHER_PID", "")
    if launcher.isdigit() and os.getppid() != int(launcher):  # it died before prctl
        os._exit(128 + signal.SIGKILL)


def _status(exc: SystemExit) -> int:
    code = exc.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)  # what Python does for sys.exit("message")
    return 1


def _report(code: int) -> None:
    """Writes ``exit.<rank>`` (atomically) into the launcher's directory."""
    directory = os.environ.get("BLOX_LAUNCH_DIR")
    rank = os.environ.get("BLOX_PROCESS_ID", "0")
    if not directory:
        return
    path = os.path.join(directory, f"exit.{rank}")
    try:
        with open(path + ".tmp", "w") as f:
            f.write(str(code))
        os.replace(path + ".tmp", path)
    except OSError:  # the launcher is gone: nothing to tell
        pass


def _user_traceback(tb):
    while tb is not None and tb.tb_frame.f_code.co_filename in _HIDDEN:
        tb = tb.tb_next
    return tb


def main() -> int:
    _die_with_launcher()
    command = sys.argv[1:]
    try:
        if command[0] == "-m":
            sys.argv = command[1:]
            sys.path[0] = os.getcwd()  # as python -m does
            runpy.run_module(command[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = command
            sys.path[0] = os.path.dirname(os.path.abspath(command[0]))  # as python SCRIPT
            runpy.run_path(command[0], run_name="__main__")
        code = 0
    except SystemExit as e:
        code = _status(e)
    except BaseException as e:  # noqa: BLE001 - printed as Python would, then reported
        e.__traceback__ = _user_traceback(e.__traceback__)
        sys.excepthook(type(e), e, e.__traceback__)
        code = 128 + signal.SIGINT if isinstance(e, KeyboardInterrupt) else 1
    sys.stdout.flush()
    sys.stderr.flush()
    if code:
        _report(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
