"""The model both sides of the KV crash test build (same seed, same fingerprint)."""

from durablekv.llm.model import TinyTransformer

BLOCK_SIZE = 4


def make_model() -> TinyTransformer:
    return TinyTransformer(vocab_size=64, num_layers=2, num_heads=2, num_kv_heads=1,
                           head_dim=4, seed=11)


def run_then_kill(worker, directory, want: int, seed: int, max_extra: int) -> list[list[str]]:
    """Run the worker script ``worker`` on ``directory``, read its reports
    (one line each, split into words) until ``want`` plus a random 0 ..
    ``max_extra - 1`` more (``seed``) arrived, then SIGKILL it at once, mid-work.
    Fails (never hangs) when the worker is silent for 60 s or exits early."""
    import os
    import random
    import signal
    import subprocess
    import sys
    import threading
    import time
    from pathlib import Path

    import pytest

    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    proc = subprocess.Popen([sys.executable, str(worker), str(directory)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    lines: list[list[str]] = []
    target = want + random.Random(seed).randrange(0, max_extra)
    deadline = time.monotonic() + 60
    watchdog = threading.Timer(90, proc.kill)        # a silent worker cannot hang the test
    watchdog.start()
    try:
        while len(lines) < target:
            assert time.monotonic() < deadline, f"the worker reported {len(lines)} in 60 s"
            line = proc.stdout.readline().decode()
            if not line:
                pytest.fail(f"the worker exited early: {proc.stderr.read().decode()[-2000:]}")
            lines.append(line.split())
    finally:
        watchdog.cancel()
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        proc.stdout.close()
        proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL
    return lines
