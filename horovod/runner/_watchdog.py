"""The watchdog every worker runs under: ends the worker's process group when the launcher is gone.

Standalone on purpose (standard library only, nothing from horovod): the launcher runs this file as
``python -I <path>`` for local workers, and ssh runs its text with ``python -u -c`` on remote hosts, where
horovod may live elsewhere.  The first line of stdin is the worker's description, JSON
``{"command", "grace", "local", ["cwd"], ["env"]}``; the rest of stdin is the lifeline: end of file means
the launcher (or the ssh connection) is gone, and nobody else will stop the worker.  The watchdog then
sends SIGTERM (and SIGCONT, for a stopped worker) to the worker's process group, waits up to ``grace``
seconds for the worker, and SIGKILLs the group -- grandchildren included, whatever the command is.

``local``: the worker shares the watchdog's process group (the launcher made the watchdog a session
leader), so the launcher's group signals reach the worker directly and the watchdog only waits for it,
then exits with the worker's status -- dying of the same signal if the worker did.  Otherwise (remote) the
worker gets a group of its own and a signal to the watchdog is forwarded to that group.  Either way, what
the worker left running in its group is killed when it exits.
"""

import json
import os
import signal
import subprocess
import sys
import threading
import time

_KILL_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)


def _group_members(pgid):
    """Pids of the group ``pgid`` other than this process (from /proc; empty where there is none)."""
    me, found = os.getpid(), []
    try:
        names = os.listdir("/proc")
    except OSError:
        return found
    for name in names:
        if not name.isdigit() or int(name) == me:
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                data = f.read()
            if int(data[data.rindex(b")") + 2:].split()[2]) == pgid:  # fields: state ppid pgrp ...
                found.append(int(name))
        except (OSError, ValueError, IndexError):
            pass
    return found


def _kill(pids, sig):
    for pid in pids:
        try:
            os.kill(pid, sig)
        except OSError:
            pass


def _exit_like(rc):
    """Exit with the worker's status; if a signal killed it, die of the same signal (no core file)."""
    sys.stdout.flush()
    if rc < 0:
        try:
            import resource

            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        except (ImportError, OSError, ValueError):
            pass
        try:
            signal.signal(-rc, signal.SIG_DFL)
        except (OSError, ValueError):  # SIGKILL and SIGSTOP have no handler to reset
            pass
        os.kill(os.getpid(), -rc)
        time.sleep(1)
    os._exit(rc if rc >= 0 else 128 - rc)


def main():
    cfg = json.loads(sys.stdin.buffer.readline())
    host = os.uname().nodename
    local = bool(cfg.get("local"))
    if cfg.get("cwd"):
        try:
            os.chdir(cfg["cwd"])
        except OSError as e:
            sys.stderr.write(f"horovodrun: cannot change to {cfg['cwd']} on {host}: {e}\n")
            sys.exit(127)
    cmd = cfg["command"]
    argv = ["/bin/sh", "-c", cmd] if isinstance(cmd, str) else cmd
    try:
        p = subprocess.Popen(argv, env=cfg.get("env"), stdin=subprocess.DEVNULL, start_new_session=not local)
    except OSError as e:
        sys.stderr.write(f"horovodrun: cannot start {argv[0]} on {host}: {e}\n")
        sys.exit(127)
    pgid = os.getpgrp() if local else p.pid
    lock = threading.Lock()  # held while the group is being killed, and by the final exit
    orphaned = threading.Event()

    def kill_group(grace):
        # SIGTERM the group, give the worker `grace` seconds, SIGKILL the group.  Locally the group includes
        # this process, which is why only an orphaned watchdog does it (its status interests nobody).
        with lock:
            try:
                os.killpg(pgid, signal.SIGTERM)
            except OSError:
                return
            try:  # a stopped (SIGSTOP) worker acts on SIGTERM only once resumed: it waited out the grace
                os.killpg(pgid, signal.SIGCONT)
            except OSError:
                pass
            end = time.monotonic() + grace
            while p.poll() is None and time.monotonic() < end:
                time.sleep(0.02)
            try:
                os.killpg(pgid, signal.SIGKILL)
            except OSError:
                pass

    def watch():
        while sys.stdin.buffer.read1(65536):
            pass
        orphaned.set()
        kill_group(cfg["grace"])

    if local:
        for s in _KILL_SIGNALS:  # a handler, not SIG_IGN: the group's signal must still reach the worker
            signal.signal(s, lambda signum, frame: None)
    else:
        def on_signal(signum, frame):
            kill_group(cfg["grace"])
            os._exit(128 + signum)

        for s in _KILL_SIGNALS:
            signal.signal(s, on_signal)
    threading.Thread(target=watch, daemon=True).start()
    rc = p.wait()
    if not local:
        kill_group(0)
        sys.stdout.flush()
        os._exit(rc if rc >= 0 else 128 - rc)
    with lock:  # an orphaning after this point finds the lock taken: the leftovers are dealt with here
        if orphaned.is_set():
            os.killpg(pgid, signal.SIGKILL)
        left = _group_members(pgid)
        if left:
            _kill(left, signal.SIGTERM)
            _kill(left, signal.SIGKILL)
        _exit_like(rc)


if __name__ == "__main__":
    main()
