"""`durablekv replay` on the real traces and the generated workload."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from durablekv import Cache
from durablekv.cli import main

from .conftest import interrupt_first_removal, owner_process, trace_path

REPO = Path(__file__).resolve().parents[1]

REPORT_KEYS = {
    "requests", "gets", "sets", "deletes", "memory_hits", "store_hits", "misses", "hit_ratio",
    "memory_hit_ratio", "store_hit_ratio", "evictions", "page_faults", "flushes",
    "flushed_pages", "cache_sets", "requests_per_second", "get_latency_p50_us",
    "get_latency_p99_us", "set_latency_p50_us", "set_latency_p99_us",
    "overall_hit_ratio", "memory_slots",
}

LARGER_TRACES = ["cache2k_orm-busy.i32be", "arc_OLTP.lis", "scarab_recs.i64be",
                 "cloudPhysicsIO.csv"]


def run_cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-m", "durablekv", *args], capture_output=True,
                          text=True, env=env, cwd=cwd, timeout=900)


def replay_json(tmp_path: Path, *args: str) -> dict:
    out = tmp_path / "report.json"
    assert main(["replay", *args, "--json", str(out), "--no-progress"]) == 0
    return json.loads(out.read_text())


def check_report(r: dict, requests: int) -> None:
    assert REPORT_KEYS <= set(r), REPORT_KEYS - set(r)
    assert r["requests"] == requests
    assert r["gets"] + r["sets"] + r["deletes"] == requests
    assert r["memory_hits"] + r["store_hits"] + r["misses"] == r["gets"]
    assert r["hit_ratio"] == pytest.approx((r["memory_hits"] + r["store_hits"]) / r["gets"])
    assert 0 <= r["memory_hit_ratio"] <= r["hit_ratio"] <= 1
    assert r["overall_hit_ratio"] == r["hit_ratio"]
    assert r["memory_slots"] == r["page_size"] * r["max_pages"]
    assert r["requests_per_second"] > 0


@pytest.mark.parametrize("name", LARGER_TRACES)
def test_replay_each_larger_trace_prefix(tmp_path, name):
    r = replay_json(tmp_path, str(trace_path(name)), "--limit", "30000", "--max-pages", "256")
    check_report(r, 30_000)
    assert r["misses"] > 0 and r["hits"] > 0


@pytest.mark.stress
@pytest.mark.parametrize("name", LARGER_TRACES)
def test_replay_each_larger_trace_whole(tmp_path, name):
    """The whole trace, through the real command line in a subprocess."""
    out = tmp_path / "r.json"
    proc = run_cli("replay", str(trace_path(name)), "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "hit ratio" in proc.stdout and "throughput" in proc.stdout
    r = json.loads(out.read_text())
    expected = {"cache2k_orm-busy.i32be": 5_000_000, "arc_OLTP.lis": 914_145,
                "scarab_recs.i64be": 1_245_184, "cloudPhysicsIO.csv": 113_872}[name]
    check_report(r, expected)


def test_report_leads_with_the_memory_hit_ratio_the_one_an_lru_compares_with(tmp_path,
                                                                            capsys):
    """On cloudPhysics the store (which never evicts) serves most hits, so the
    overall ratio is far above any LRU of the memory's size. The report leads
    with the memory tier's ratio, which at page_size=1 is exactly an LRU's."""
    from bench import sim

    trace = trace_path("cloudPhysicsIO.csv")
    r = replay_json(tmp_path, str(trace), "--limit", "20000", "--page-size", "1",
                    "--max-pages", "490")
    lru_hits = sim.lru(sim.load(trace, 20000), 490)
    assert r["memory_hits"] == lru_hits
    assert r["memory_hit_ratio"] == pytest.approx(lru_hits / r["gets"])
    assert r["hit_ratio"] > 5 * r["memory_hit_ratio"]  # mostly store hits
    lines = capsys.readouterr().out.splitlines()
    ratios = [i for i, line in enumerate(lines) if "hit ratio" in line]
    memory, overall = lines[ratios[0]], lines[ratios[1]]
    assert memory.startswith("memory hit ratio") and f"{100 * r['memory_hit_ratio']:.2f} %" in memory
    assert "LRU cache of 490 entries" in memory and "exactly" in lines[ratios[0] + 1]
    assert overall.startswith("overall hit ratio") and f"{100 * r['hit_ratio']:.2f} %" in overall
    assert "never evicts" in overall and "unbounded" in lines[ratios[1] + 1]


def test_report_says_a_page_grained_memory_tier_is_not_an_exact_lru(tmp_path, capsys):
    replay_json(tmp_path, "--requests", "2000", "--keys", "500", "--page-size", "4",
                "--max-pages", "20")
    out = " ".join(capsys.readouterr().out.split())   # unwrap the report's lines
    assert "not an LRU figure at this page size" in out
    assert "all 4 entries of a page" in out and "LRU cache of 80 entries" in out
    assert "replay with --page-size 1 --max-pages 80" in out
    assert "compare this one" not in out


def test_report_at_page_size_1_is_the_lru_figure(tmp_path, capsys):
    replay_json(tmp_path, "--requests", "2000", "--keys", "500", "--page-size", "1",
                "--max-pages", "80")
    out = " ".join(capsys.readouterr().out.split())
    assert "compare this one with an LRU cache of 80 entries" in out
    assert "the memory tier is exactly such an LRU" in out


def test_replay_cachelib_sample_with_ttls_and_deletes(tmp_path):
    r = replay_json(tmp_path, str(trace_path("metakv_cachelib_sample1.csv")))
    check_report(r, 691)
    assert r["deletes"] > 0 and r["sets"] > 0


def test_replay_generated_workload_runs_without_shared(tmp_path):
    """The README's first command: no trace file needed."""
    proc = run_cli("replay", "--requests", "20000", "--keys", "2000", "--json",
                   str(tmp_path / "r.json"), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    for label in ("requests", "hit ratio", "evictions", "page faults", "flushes", "throughput",
                  "get latency", "set latency"):
        assert label in proc.stdout
    check_report(json.loads((tmp_path / "r.json").read_text()), 20_000)


def test_skewed_replay_coalesces_writes(tmp_path):
    """Replaying a skewed trace writes far fewer pages to SQLite than it performs sets."""
    r = replay_json(tmp_path, str(trace_path("cache2k_orm-busy.i32be")), "--limit", "300000",
                    "--max-pages", "64")
    assert r["cache_sets"] == r["misses"] > 10_000
    assert r["flushed_pages"] * 8 < r["cache_sets"], (r["flushed_pages"], r["cache_sets"])


def test_hot_key_overwrites_coalesce(tmp_path):
    """Half the requests are sets of Zipf-hot keys: many sets share one page write."""
    r = replay_json(tmp_path, "--requests", "200000", "--keys", "5000", "--alpha", "1.1",
                    "--set-fraction", "0.5", "--max-pages", "400")
    assert r["cache_sets"] > 90_000
    assert r["flushed_pages"] * 3 < r["cache_sets"], (r["flushed_pages"], r["cache_sets"])


def test_replay_into_existing_dir_is_warm(tmp_path):
    d = tmp_path / "warm"
    first = replay_json(tmp_path, "--requests", "5000", "--keys", "500", "--dir", str(d))
    second = replay_json(tmp_path, "--requests", "5000", "--keys", "500", "--dir", str(d))
    assert first["misses"] > 0
    assert second["misses"] == 0  # every key is in the store after the first run


def test_bad_trace_gets_a_clear_error(tmp_path, capsys):
    bad = tmp_path / "bad.lis"
    bad.write_text("1 1 0 0\n2 1 0 0\nthree 1 0 0\n")
    assert main(["replay", str(bad), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "bad.lis:3" in err and "Traceback" not in err
    assert "pass --format explicitly" in err
    # named with --format: the advice is to check the file, not to name one
    assert main(["replay", str(bad), "--format", "arc", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "bad.lis:3" in err and "--format names" in err and "explicitly" not in err


def test_unknown_format_and_missing_file(tmp_path, capsys):
    odd = tmp_path / "trace.bin"
    odd.write_bytes(b"\x00\x01\x02")
    assert main(["replay", str(odd), "--no-progress"]) == 2
    assert "trace.bin" in capsys.readouterr().err
    assert main(["replay", str(tmp_path / "nope.lis"), "--no-progress"]) == 2
    assert "nope.lis" in capsys.readouterr().err


def test_bad_options_are_rejected_by_the_parser(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["replay", "--max-pages", "0"])
    assert exc.value.code == 2
    assert "max-pages" in capsys.readouterr().err


@pytest.mark.parametrize("argv, unknown", [
    (["replay", "--bogus"], "--bogus"), (["replay", "t.lis", "extra"], "extra"),
    (["check", "--bogus", "DIR"], "--bogus"), (["check", "DIR", "extra"], "extra"),
    # no DIR: the mistyped option is named, not the missing DIR
    (["check", "--bogus"], "--bogus"), (["check", "--dir=x"], "--dir=x"),
    (["replay", "--durab", "log", "--bogus"], "--bogus")])
def test_unknown_argument_after_a_subcommand_shows_that_subcommands_usage(argv, unknown, capsys):
    """Not the top-level usage (``durablekv [-h] [--version] {replay,check}``),
    which does not list the options the user was looking for."""
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"usage: durablekv {argv[0]} [-h]"), err
    assert f"durablekv {argv[0]}: error: unrecognized arguments: {unknown}\n" in err, err
    if argv[0] == "replay":
        assert "--salvage-log" in err  # the subcommand's own options are listed


def test_option_prefixes_negative_numbers_and_dashed_paths_are_not_unknown(tmp_path, capsys):
    """argparse's own rules stand: an unambiguous prefix of an option, a
    negative number as a value, anything after ``--`` as a positional."""
    assert main(["check", "--", "-no-such-dir"]) == 2  # could not check: no such directory
    assert "-no-such-dir: no such directory" in capsys.readouterr().out
    assert main(["replay", "--durab", "none", "--seed", "-3", "--requests", "200",
                 "--keys", "50", "--no-progress"]) == 0
    assert "hit ratio" in capsys.readouterr().out


def test_unknown_argument_before_the_subcommand_shows_the_top_level_usage(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--bogus", "replay"])
    assert exc.value.code == 2
    assert capsys.readouterr().err.startswith("usage: durablekv [-h] [--version]")


def test_cli_errors_are_one_line_messages(tmp_path, capsys):
    """No traceback for a directory as TRACE, a bad port, --hold alone, a bad --json path."""
    (tmp_path / "adir").mkdir()
    assert main(["replay", str(tmp_path / "adir"), "--no-progress"]) == 2
    assert "is a directory; pass a trace file" in capsys.readouterr().err
    assert main(["replay", "--requests", "10", "--hold", "3", "--no-progress"]) == 2
    assert "needs --metrics-port" in capsys.readouterr().err
    assert main(["replay", "--requests", "10", "--json", str(tmp_path / "no" / "r.json")]) == 2
    assert "not a writable directory" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["replay", "--metrics-port", "99999"])
    assert "0..65535" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["replay", "--set-fraction", "2"])
    assert "set-fraction" in capsys.readouterr().err


def test_replay_dir_adopts_the_stored_page_size(tmp_path):
    d = str(tmp_path / "d")
    first = replay_json(tmp_path, "--requests", "2000", "--dir", d, "--page-size", "1")
    second = replay_json(tmp_path, "--requests", "2000", "--dir", d)
    assert first["page_size"] == second["page_size"] == 1


def test_value_size_over_the_limit_names_the_request(tmp_path, capsys):
    trace = tmp_path / "big.csv"
    trace.write_text("op_time,key,key_size,op,op_count,size,cache_hits,ttl\n"
                     "1,k1,2,SET,1,10,0,0\n"
                     "2,k2,2,SET,1,999999999999,0,0\n")
    for fmt in ([], ["--format", "cachelib"]):
        assert main(["replay", str(trace), "--no-progress", *fmt]) == 2
        err = capsys.readouterr().err
        assert "request 2" in err and "max_value_bytes" in err
        assert "--format" not in err   # the file is fine: no advice about formats


def test_check_tells_errors_from_damage(tmp_path, capsys):
    """Could not check: exit 2 and ERROR lines; damage: exit 1 (other tests)."""
    assert main(["check", str(tmp_path / "missing")]) == 2
    assert "ERROR" in capsys.readouterr().out
    (tmp_path / "afile").write_text("x")
    assert main(["check", str(tmp_path / "afile")]) == 2
    assert "a file, not a cache directory" in capsys.readouterr().out
    (tmp_path / "empty").mkdir()
    assert main(["check", str(tmp_path / "empty")]) == 2
    assert "not a durablekv cache directory" in capsys.readouterr().out


def test_directory_arguments_take_a_leading_tilde_as_cache_does(home, capsys):
    """`--dir=~/c` (no shell expands a tilde after '='), or a quoted '~/c':
    $HOME/c, as Cache('~/c') takes it, for every command."""
    assert main(["replay", "--requests", "300", "--dir=~/c", "--no-progress"]) == 0
    assert (home / "c" / "pages.sqlite3").exists()
    assert main(["check", "~/c"]) == 0
    assert main(["salvage", "~/c"]) == 0
    assert f"{home / 'c'}" in capsys.readouterr().out
    assert os.listdir(".") == []


def test_check_names_the_process_that_holds_the_cache_open(tmp_path, capsys):
    """As CacheLockedError does: the pid comes from the LOCK file."""
    d = tmp_path / "c"
    owner = owner_process(d)
    try:
        assert main(["check", str(d)]) == 2
        out = capsys.readouterr().out
        assert f"{d} is open in process {owner.pid}; close the cache there" in out, out
        assert "NOT CHECKED" in out and "DAMAGE" not in out
        owner.stdin.write("\n")
        owner.stdin.flush()
        assert owner.wait(timeout=60) == 0
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait()
    assert main(["check", str(d)]) == 0  # closed: checked, and healthy


def test_replay_options_that_cannot_apply_are_refused(tmp_path, capsys):
    trace = tmp_path / "t.lis"
    trace.write_text("1 1 0 1\n")
    cases = [
        (["--value-size", str(64 << 20 | 1)], "pass at most --value-size"),
        ([str(trace), "--requests", "100"], "do nothing with a TRACE; use --limit"),
        ([str(trace), "--seed", "3"], "--seed shape the generated Zipf workload"),
        (["--requests", "5", "--json", str(tmp_path)], "it is a directory; name a file"),
    ]
    for argv, words in cases:
        assert main(["replay", *argv, "--no-progress"]) == 2, argv
        assert words in capsys.readouterr().err, argv
    with pytest.raises(SystemExit):
        main(["replay", "--requests", "5", "--metrics-port", "0", "--hold", "-1"])
    assert "0 or more seconds" in capsys.readouterr().err


def test_sigterm_closes_the_cache_and_removes_the_temporary_directory(tmp_path):
    """``timeout`` and ``kill`` send SIGTERM: the replay unwinds like Ctrl-C."""
    env = dict(os.environ, TMPDIR=str(tmp_path))
    proc = subprocess.Popen([sys.executable, "-m", "durablekv", "replay", "--requests",
                             "100000000", "--no-progress"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not any(p.name.startswith("durablekv-replay-") and (p / "LOCK").exists()
                  for p in tmp_path.iterdir()):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _out, err = proc.communicate(timeout=60)
    assert proc.returncode == 143 and "terminated" in err, err
    assert list(tmp_path.iterdir()) == []


def test_sigterm_as_the_temporary_directory_is_made_still_removes_it(tmp_path, monkeypatch,
                                                                   capsys):
    """SIGTERM's handler raises where the signal lands: as mkdir returned
    the temporary directory (inside tempfile.mkdtemp), the replay exited 143
    and left the directory behind, because what removes it began later."""
    import tempfile

    from durablekv import cli

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    real = os.mkdir

    def interrupted(path, *args, **kwargs):
        real(path, *args, **kwargs)
        if os.path.basename(path).startswith("durablekv-replay-"):
            cli._terminate(signal.SIGTERM, None)  # the signal lands as mkdir returns

    monkeypatch.setattr(os, "mkdir", interrupted)
    assert main(["replay", "--requests", "1000", "--no-progress"]) == 143
    assert capsys.readouterr().err == "durablekv: terminated\n"
    assert list(tmp_path.iterdir()) == []


def test_sigterm_as_the_temporary_directory_is_removed_still_removes_all_of_it(
        tmp_path, monkeypatch, capsys):
    """A replay that ends removes its temporary directory; SIGTERM landing
    in that removal (the handler's exception raised as a file's unlink
    returns) stopped it halfway and left the directory behind."""
    import tempfile

    from durablekv import cli

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    removing = interrupt_first_removal(
        monkeypatch, lambda: cli._terminate(signal.SIGTERM, None))
    assert main(["replay", "--requests", "1000", "--no-progress"]) == 143
    assert "cut" in removing
    assert capsys.readouterr().err == "durablekv: terminated\n"
    assert list(tmp_path.iterdir()) == []


def test_a_sigterm_whose_exception_was_lost_still_stops_the_replay(tmp_path, capsys,
                                                                  monkeypatch):
    """A signal handler's exception is only reported, not raised, when it
    lands in a __del__ or a gc callback; the replay loop also checks the flag
    the handler sets, so SIGTERM stops it within 16,384 requests anyway."""
    from durablekv import cli
    monkeypatch.setattr(cli, "_terminating", [True])   # as if the exception was lost
    rc = main(["replay", "--requests", "1000000", "--no-progress", "--dir", str(tmp_path / "c")])
    assert rc == 143 and "terminated" in capsys.readouterr().err
    assert cli._terminating == [False]                  # reset for the next main()
    with Cache(tmp_path / "c") as cache:                # closed cleanly on the way out
        assert cache.stats().recovered_records == 0 and 0 < len(cache) <= 16384


def test_a_closed_stdout_does_not_lose_the_json_report(tmp_path):
    """``durablekv replay ... --json r.json | head -1``: the reader leaves
    before the report is printed; the JSON is still written, exit 0."""
    report = tmp_path / "r.json"
    proc = subprocess.Popen([sys.executable, "-m", "durablekv", "replay", "--requests", "20000",
                             "--no-progress", "--json", str(report)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc.stdout.close()  # long before the replay can print anything
    _out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert json.loads(report.read_text())["requests"] == 20000
    assert "Broken pipe" not in err and "Traceback" not in err, err


def _flags_of(subcommand: str) -> set[str]:
    from durablekv.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    return set(sub.choices[subcommand]._option_string_actions)


def test_every_flag_an_error_hint_names_exists_on_a_subcommand_that_can_print_it():
    """_API_TO_FLAGS turns the API's words into flags; a flag no subcommand
    has would be advice the command line refuses. _for_cli rewrites a
    phrase only for a subcommand that has the flag."""
    from durablekv.cli import _API_TO_FLAGS, _flag_of, _for_cli

    all_flags = set().union(*(_flags_of(c) for c in ("replay", "check", "salvage")))
    for api, flag in _API_TO_FLAGS:
        assert _flag_of(flag) in all_flags, (api, flag)
    salvage = frozenset(_flags_of("salvage"))
    msg = "open it without page_size (or with page_size=16); Open with salvage_log=True"
    assert "--" not in _for_cli(ValueError(msg), salvage)
    assert "--page-size" in _for_cli(ValueError(msg), frozenset(_flags_of("replay")))


def _damage_the_store(d: Path) -> None:
    from durablekv import Cache

    with Cache(d) as cache:
        cache["k"] = b"v"
    with open(d / "pages.sqlite3", "r+b") as f:
        f.write(b"\x00garbage" * 20)


def test_salvage_advice_for_a_damaged_store_names_a_flag_salvage_takes(tmp_path, capsys):
    """salvage printed "--on-corruption rebuild" for a damaged store, then
    refused that very option. It takes it now, and it works."""
    d = tmp_path / "c"
    _damage_the_store(d)
    assert main(["salvage", str(d)]) == 1
    err = capsys.readouterr().err
    assert "--on-corruption rebuild" in err, err
    assert main(["salvage", "--on-corruption", "rebuild", str(d)]) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith("result  REBUILT")
    assert any(p.name.startswith("pages.sqlite3.corrupt-") for p in d.iterdir())
    assert main(["check", str(d)]) == 0


def test_replay_and_salvage_take_every_serializer_name(tmp_path, capsys):
    """replay had no --serializer although its error said "open it with
    serializer='pickle'"; salvage refused "json", which README calls another
    name for "safe". replay now adopts a store's serializer by default, and
    an explicit wrong one gets advice replay takes."""
    from durablekv import Cache

    pickled = tmp_path / "p"
    with Cache(pickled, serializer="pickle") as cache:
        cache["obj"] = {1, 2}
    r = replay_json(tmp_path, "--requests", "500", "--dir", str(pickled))
    assert r["requests"] == 500
    assert main(["replay", "--requests", "500", "--dir", str(pickled), "--serializer", "safe",
                 "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "pass --serializer pickle" in err and "open it with" not in err, err
    r = replay_json(tmp_path, "--requests", "500", "--dir", str(pickled),
                    "--serializer", "pickle")
    assert r["requests"] == 500
    with Cache(pickled, serializer="pickle") as cache:
        assert cache["obj"] == {1, 2}

    safe = tmp_path / "s"
    with Cache(safe) as cache:
        cache["a"] = 1
    for name in ("json", "safe"):
        assert main(["salvage", "--serializer", name, str(safe)]) == 0
        assert capsys.readouterr().out.splitlines()[-1].startswith("result  NOTHING TO SALVAGE")
        r = replay_json(tmp_path, "--requests", "500", "--dir", str(safe), "--serializer", name)
        assert r["requests"] == 500
    assert main(["salvage", "--serializer", "pickle", str(safe)]) == 2
    assert "pass --serializer safe" in capsys.readouterr().err


def test_check_of_an_empty_path_is_an_error_not_the_current_directory(tmp_path, capsys,
                                                                     monkeypatch):
    """``durablekv check ''`` (an unset shell variable) checked the current
    directory: in a healthy cache it said "healthy" about a directory nobody
    named. It is a could-not-check error (exit 2), like a missing one."""
    from durablekv import Cache

    d = tmp_path / "c"
    with Cache(d) as cache:
        cache["k"] = 1
    monkeypatch.chdir(d)
    assert main(["check", ""]) == 2
    out = capsys.readouterr().out
    assert "ERROR   the cache directory is an empty path" in out and "'.'" in out, out
    assert main(["check", "."]) == 0


def test_a_busy_metrics_port_names_the_flag_to_change(tmp_path, capsys):
    """The CLI reuses the library's message, with --metrics-port for port=."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert main(["replay", "--requests", "10", "--metrics-port", str(port),
                     "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err == (f"durablekv: cannot serve metrics on 127.0.0.1:{port}: Address already in "
                   "use; the port is taken (by another program, or by a server not closed "
                   "yet); pick another --metrics-port (0 picks a free one)\n")


def test_checks_advice_for_a_damage_marker_is_a_command_that_works(tmp_path, capsys):
    """check named a bare "--on-corruption rebuild", which check itself does
    not take; it names the salvage command that does, and that works."""
    from durablekv import Cache
    from durablekv.stores.sqlitefile import mark_damaged

    d = tmp_path / "c"
    with Cache(d) as cache:
        cache["k"] = 1
    mark_damaged(str(d / "pages.sqlite3"), "a test says so")
    assert main(["check", str(d)]) == 1
    out = capsys.readouterr().out
    assert f"`durablekv salvage --on-corruption rebuild {d}`" in out, out
    assert main(["salvage", "--on-corruption", "rebuild", str(d)]) == 0
    capsys.readouterr()
    assert main(["check", str(d)]) == 0


def test_a_json_report_that_cannot_be_written_still_prints_the_report(tmp_path, monkeypatch,
                                                                      capsys):
    """The --json directory goes away during the replay: the report is
    printed, then one message names the real path and the reason; exit 1."""
    from durablekv import cli
    out_dir = tmp_path / "reports"
    out_dir.mkdir()
    real_replay = cli.replay

    def replay_after_the_directory_went(*a, **kw):
        out_dir.rmdir()
        return real_replay(*a, **kw)

    monkeypatch.setattr(cli, "replay", replay_after_the_directory_went)
    monkeypatch.chdir(tmp_path)
    rc = main(["replay", "--requests", "2000", "--keys", "200", "--no-progress",
               "--json", "reports/r.json"])
    captured = capsys.readouterr()
    assert rc == 1
    assert "hit ratio" in captured.out.lower()  # the report came first
    err = captured.err.strip()
    assert len(err.splitlines()) == 1, err
    assert str(out_dir / "r.json") in err
    assert "could not be written" in err and "No such file or directory" in err
    assert "no such file:" not in err


def test_replay_policy_tinylfu_beats_lru_on_a_zipf_trace(tmp_path):
    """``--policy tinylfu`` reaches the cache: on scarab (stationary Zipf) its
    memory hit ratio is above LRU's at the same memory, and the report says which."""
    ratios = {}
    for policy in ("lru", "tinylfu"):
        (tmp_path / policy).mkdir()
        r = replay_json(tmp_path / policy, str(trace_path("scarab_recs.i64be")), "--limit",
                        "100000", "--page-size", "1", "--max-pages", "500",
                        "--policy", policy)
        assert r["policy"] == policy
        ratios[policy] = r["memory_hit_ratio"]
    assert ratios["tinylfu"] > ratios["lru"] + 0.01, ratios


def test_report_says_why_the_store_is_above_size_limit(tmp_path, capsys):
    """Resident pages are never evicted from the store: with a size_limit
    below the memory tier's bytes, the report says so instead of looking broken."""
    r = replay_json(tmp_path, "--requests", "20000", "--keys", "5000",
                    "--max-memory-bytes", "8MiB", "--size-limit", "64KiB")
    assert r["store_data_bytes"] > r["size_limit"]
    out = " ".join(capsys.readouterr().out.split())
    assert "above size_limit: pages resident in memory are never evicted from the store" in out
    (tmp_path / "b").mkdir()
    r = replay_json(tmp_path / "b", "--requests", "20000", "--keys", "5000", "--max-pages", "4",
                    "--size-limit", "64KiB")
    assert r["store_data_bytes"] <= r["size_limit"] and r["store_evictions"] > 0
    assert "above size_limit" not in capsys.readouterr().out
