"""The replay log: the record format and its segments, the log that appends
and recovers them, and the control file that says what the log held.

* :mod:`durablekv.log.segments`: the on-disk format (its module docstring is
  the spec), reading and scanning one segment, the checkpoint position;
* :mod:`durablekv.log.control`: ``replay.control``, which lets recovery tell
  a lost segment from a log that never held one;
* :mod:`durablekv.log.replaylog`: :class:`ReplayLog`, appends with group
  fsync, segment rolls, recovery of the records after a checkpoint, and the
  cut back once a checkpoint passes them;
* :mod:`durablekv.log.recovery`: :class:`~durablekv.log.recovery.LogReplay`,
  which applies the recovered records to a memory tier.

Nothing here knows a cache: recovery returns records (see
:class:`RecoveryResult`), and ``LogReplay`` is handed the parts it applies
them through.
"""

from .replaylog import RecoveryResult, ReplayLog
from .segments import OP_CLEAR, OP_DELETE, OP_SET, LogRecord

__all__ = ["ReplayLog", "RecoveryResult", "LogRecord", "OP_SET", "OP_DELETE", "OP_CLEAR"]
