"""The live server against a schema fuzzer and against a dict.

- schemathesis (all its checks; examples, coverage, fuzzing and stateful
  phases) run against a real ``durablekv serve`` with a token, a bounded
  number of examples and a fixed seed: no 5xx, no answer outside the schema.
- A hypothesis property: a sequence of HTTP operations through the client
  and the same sequence on a dict agree.
"""

from __future__ import annotations

import itertools
import subprocess
import sys
from pathlib import Path

import pytest

from tests.server_util import running_server

pytest.importorskip("schemathesis")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from durablekv.client import Client  # noqa: E402
from durablekv.errors import RemoteTypeError  # noqa: E402

TOKEN = "fuzz-token"
CONFIG = Path(__file__).with_name("schemathesis.toml")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    base = tmp_path_factory.mktemp("fuzz")
    (base / "token").write_text(TOKEN + "\n")
    with running_server(base / "cache", "--token-file", str(base / "token"),
                        "--max-value-bytes", "65536", "--max-key-chars", "256") as srv:
        yield srv


@pytest.mark.parametrize("examples, seed", [
    (25, 19),
    pytest.param(300, None, marks=pytest.mark.stress),  # a longer run, a fresh seed each time
])
def test_schemathesis_finds_no_5xx_and_no_schema_violation(server, tmp_path, examples, seed):
    cmd = [sys.executable, "-m", "schemathesis.cli", "--config-file", str(CONFIG), "run",
           server.url + "/openapi.json", "--checks", "all", "--max-examples", str(examples),
           *(("--seed", str(seed)) if seed is not None else ()), "--workers", "1", "--no-shrink",
           "--phases", "examples,coverage,fuzzing,stateful",
           "-H", f"Authorization: Bearer {TOKEN}", "--request-timeout", "20",
           "--report", "junit", "--report-dir", str(tmp_path)]
    # cwd: schemathesis keeps a cache of what it found in ./.schemathesis
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=1200, cwd=str(tmp_path))
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-6000:]
    assert "Stateful" in out and "API Links" in out, out[-3000:]
    assert "5xx" not in server.stderr() and "Traceback" not in server.stderr()


_json = st.recursive(
    st.none() | st.booleans() | st.integers(-(1 << 70), 1 << 70)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner,
                                                               max_size=3),
    max_leaves=6)
_values = _json | st.binary(max_size=16)
_keys = st.sampled_from(["a", "b/c", "ü d", "e"])
_ops = st.lists(st.one_of(
    st.tuples(st.just("set"), _keys, _values),
    st.tuples(st.just("add"), _keys, _values),
    st.tuples(st.just("get"), _keys, st.none()),
    st.tuples(st.just("contains"), _keys, st.none()),
    st.tuples(st.just("delete"), _keys, st.none()),
    st.tuples(st.just("incr"), _keys, st.integers(-1000, 1000)),
), max_size=25)

_runs = itertools.count()


def test_http_operations_agree_with_a_dict(server):
    with Client(server.url, token=TOKEN) as kv:

        @settings(max_examples=40, deadline=None, derandomize=True,
                  suppress_health_check=[HealthCheck.function_scoped_fixture,
                                         HealthCheck.too_slow])
        @given(_ops)
        def check(ops):
            prefix = f"prop{next(_runs)}/"
            model: dict = {}
            for op, k, arg in ops:
                key = prefix + k
                if op == "set":
                    kv.set(key, arg)
                    model[key] = arg
                elif op == "add":
                    assert kv.add(key, arg) == (key not in model)
                    model.setdefault(key, arg)
                elif op == "get":
                    assert kv.get(key, "<missing>") == model.get(key, "<missing>")
                elif op == "contains":
                    assert (key in kv) == (key in model)
                elif op == "delete":
                    present = key in model
                    model.pop(key, None)
                    assert kv.delete(key) == present
                elif op == "incr":
                    old = model.get(key, 0)
                    if type(old) is int:
                        model[key] = old + arg
                        assert kv.incr(key, arg) == model[key]
                    else:
                        with pytest.raises(RemoteTypeError):
                            kv.incr(key, arg)
            for k in {prefix + k for _, k, _ in ops}:
                assert kv.get(k, "<missing>") == model.get(k, "<missing>")

        check()
