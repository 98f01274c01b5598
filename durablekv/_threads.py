"""Starting and joining a background thread so that close can always wait for it."""

from __future__ import annotations

import threading
import time


#: How long start_thread waits, after an interrupted start(), for a thread to
#: report (a launched one does within microseconds; one whose launch the
#: interrupt preceded never does).
_LAUNCH_SECONDS = 2.0


def start_thread(thread: threading.Thread) -> None:
    """``thread.start()``, settled even when a signal handler's exception
    cuts it short.

    ``Thread.start`` launches the OS thread and then waits for it to report
    that it runs. An exception raised by a signal handler during that wait
    (Ctrl-C; SIGTERM in ``durablekv replay``) leaves a thread that runs but
    that ``is_alive()`` reports as not started and ``join()`` refuses to wait
    for, so a close that unwinds from the exception could neither see it nor
    wait for it. Here the wait is finished first (the thread reports within
    microseconds of being launched) and the exception then propagates. A
    thread that could not be launched at all (``RuntimeError: can't start
    new thread``) is left as it is, not started, and so is one whose
    launch the exception preceded (``start()`` lists a thread before it
    launches it): that wait ends after :data:`_LAUNCH_SECONDS`.

    Raises:
        whatever ``thread.start()`` raised.
    """
    try:
        thread.start()
    except BaseException:
        # Launched: the thread is listed (threading.enumerate() includes the
        # ones still coming up) until it has run, and is_alive() turns true
        # once it has reported. Not launched: it was taken off that list
        # before start() raised.
        # The exception can also land before the launch, with the thread
        # already listed: it never runs, so the wait has a deadline.
        deadline = time.monotonic() + _LAUNCH_SECONDS
        while (not thread.is_alive() and thread in threading.enumerate()
               and time.monotonic() < deadline):
            time.sleep(0.0001)
        raise


def join_thread(thread: threading.Thread) -> None:
    """``thread.join()``, waited out even when a signal handler's exception
    cuts it short; the exception then propagates.

    A join cut short (Ctrl-C; SIGTERM in ``durablekv replay``) returns while
    the thread still runs, and Python 3.11's ``join`` then even reports it
    as stopped (``is_alive()`` false, and a second ``join()`` returns at
    once). A close that went on from there would close the store and the log
    under a thread still using them. Here the thread's end is waited for
    first: it stays listed by ``threading.enumerate()`` until it has run.

    Raises:
        whatever ``thread.join()`` raised.
    """
    try:
        thread.join()
    except BaseException:
        while thread in threading.enumerate():
            time.sleep(0.001)
        raise
