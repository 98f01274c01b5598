"""``durablekv llm-bench``: multi-turn chats through the paged KV cache, side by side.

Workload (seeded): ``conversations`` chats, each with ``turns`` turns and one
of ``system_prompts`` shared system prompts. Turn ``k``'s prompt is the whole
history (system prompt, earlier user messages and the model's replies) plus
a new user message; its output length is drawn uniformly from
``output_len * [1 - spread, 1 + spread]`` (``spread`` = 0: all equal). Chats
are closed-loop clients: ``concurrency`` turns are in flight at once; when a
turn finishes, its chat goes to the back of the queue of chats waiting to
send their next turn, so many other turns run between two turns of one chat
(and a small pool has evicted its history by then: the durable tier's case).

Every configuration runs the same requests, and, decoding greedily, must
produce the same tokens; the report says whether it did. Times are wall
clock (:func:`time.perf_counter`), so they depend on the machine and its load;
the ratios between configurations measured in one run are what to read.
With ``repeats`` > 1 each configuration runs that many times, interleaved,
and the report gives the median and the spread (min, max).

Configurations (JSON keys):

- ``static`` / ``continuous``: the two schedulers, both with prefix caching in
  memory (as vLLM serves by default), on the same requests; ``continuous``
  is the same configuration as ``prefix_memory``, run separately.
- ``prefix_off`` / ``prefix_memory`` / ``prefix_durable``: continuous batching
  with prefix caching off, in memory only, and with full blocks written to a
  durablekv Cache as they fill (the pool's default ``write_through="async"``).
- Restarts, each in a new process on *new* requests: chats with new user
  messages and output lengths (``user_seed``) over the same system prompts,
  since a restarted server serves new traffic, not a replay.
  ``prefix_after_restart`` opens the Cache that ``prefix_durable`` left after
  a graceful shutdown (:meth:`~durablekv.llm.pool.BlockPool.spill_cached`,
  then close); ``prefix_after_kill`` opens one left by ``durable_killed``,
  the same run as ``prefix_durable`` in a child process that is sent SIGKILL
  as soon as it reports its last request finished (no spill, no close: what
  the async writer had not written yet is lost); ``restart_cold`` starts on an
  empty Cache, the baseline of a restart that kept nothing. All three must
  produce the same tokens.
- ``batching``: continuous, prefix caching in memory, one matmul per step for
  the batch vs one per sequence; and ``decode_micro``, decode steps alone at
  fixed batch sizes, the same comparison without prefill or scheduling.
- ``spread_sweep``: static vs continuous at several output-length spreads.
- ``load_sweep``: static vs continuous at several concurrencies.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import deque
from dataclasses import asdict, dataclass, replace
from typing import Any, Callable

import numpy as np

from ..cache import Cache
from .engine import LLMEngine
from .kvstore import KVBlockStore
from .model import Segment, TinyTransformer
from .scheduler import ContinuousScheduler, Request, StaticScheduler

__all__ = ["Workload", "BenchConfig", "run_workload", "run_bench", "batching_micro",
           "render_markdown", "render_findings", "render_docs", "run_child", "main"]


@dataclass(frozen=True)
class Workload:
    """The chat workload (sizes in tokens)."""

    conversations: int = 48
    turns: int = 4
    system_prompts: int = 4
    system_len: int = 96
    user_len: int = 24
    output_len: int = 48
    spread: float = 0.5
    concurrency: int = 8
    seed: int = 0
    #: seed of the user messages and output lengths (None: ``seed``); the
    #: system prompts always come from ``seed``, so another ``user_seed`` is
    #: new traffic sharing the same system prompts
    user_seed: int | None = None


@dataclass(frozen=True)
class BenchConfig:
    """Model and engine sizes."""

    vocab_size: int = 512
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    block_size: int = 16
    num_blocks: int = 160
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 512


class Chat:
    """One conversation: its fixed inputs and its history so far."""

    def __init__(self, cid: int, system: list[int], users: list[list[int]], outs: list[int]):
        self.cid, self.system, self.users, self.outs = cid, system, users, outs
        self.history = list(system)
        self.turn = 0

    def next_request(self, now: float) -> Request:
        prompt = self.history + self.users[self.turn]
        return Request((self.cid, self.turn), prompt, self.outs[self.turn], arrival_time=now)


def make_chats(w: Workload, vocab: int) -> list[Chat]:
    rng = np.random.default_rng(w.seed)
    systems = [rng.integers(0, vocab, w.system_len).tolist() for _ in range(w.system_prompts)]
    if w.user_seed is not None and w.user_seed != w.seed:
        rng = np.random.default_rng([w.seed, w.user_seed])
    chats = []
    lo = max(1, round(w.output_len * (1 - w.spread)))
    hi = max(lo, round(w.output_len * (1 + w.spread)))
    for c in range(w.conversations):
        system = systems[int(rng.integers(0, w.system_prompts))]
        users = [rng.integers(0, vocab, max(1, int(rng.integers(w.user_len // 2,
                                                                   w.user_len * 3 // 2 + 1))))
                 .tolist() for _ in range(w.turns)]
        outs = [int(rng.integers(lo, hi + 1)) for _ in range(w.turns)]
        chats.append(Chat(c, system, users, outs))
    return chats


def output_tokens(w: Workload, vocab: int) -> int:
    return sum(sum(c.outs) for c in make_chats(w, vocab))


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return 0.0
    return float(np.percentile(np.asarray(xs), q * 100, method="higher"))


class TimedKVBlockStore(KVBlockStore):
    """A :class:`KVBlockStore` that records each ``put`` and ``get``: seconds
    (:func:`time.perf_counter`, encode/decode included) and stored bytes.

    ``put`` runs on the pool's writer thread and ``get`` on the engine's, so
    each list has one writer.
    """

    def __init__(self, cache: Any, **kwargs: Any) -> None:
        super().__init__(cache, **kwargs)
        self.put_times: list[float] = []
        self.get_times: list[float] = []
        self.put_bytes = self.get_bytes = 0
        self.block_bytes = 0     # stored bytes of one block (header + payload)
        # the blocks stored when the store was opened: a restart's inheritance
        self.found_at_open = frozenset(k for k in cache.keys() if isinstance(k, bytes))
        self.reused = 0          # hits on one of those
        self.put_hashes: set[bytes] = set()

    def put(self, block_hash: bytes, kv_array: np.ndarray) -> None:
        t0 = time.perf_counter()
        super().put(block_hash, kv_array)
        self.put_times.append(time.perf_counter() - t0)
        self.put_hashes.add(block_hash)
        self.block_bytes = _stored_bytes(kv_array)
        self.put_bytes += self.block_bytes

    def get(self, block_hash: bytes) -> np.ndarray | None:
        t0 = time.perf_counter()
        kv = super().get(block_hash)
        if kv is not None:
            self.get_times.append(time.perf_counter() - t0)
            self.get_bytes += _stored_bytes(kv)
            self.reused += block_hash in self.found_at_open
        return kv

    def report(self) -> dict[str, Any]:
        """Latency percentiles (microseconds) and MB/s of the calls so far
        (MB/s: stored bytes over the seconds spent inside the calls)."""
        out: dict[str, Any] = {"block_bytes": self.block_bytes, "durable_puts": len(self.put_times),
                               "durable_gets": len(self.get_times),
                               "distinct_blocks_put": len(self.put_hashes),
                               "blocks_at_open": len(self.found_at_open),
                               "blocks_reused": self.reused}
        for op, times, nbytes in (("put", self.put_times, self.put_bytes),
                                  ("get", self.get_times, self.get_bytes)):
            out[f"durable_{op}_p50_us"] = _pct(times, 0.5) * 1e6
            out[f"durable_{op}_p99_us"] = _pct(times, 0.99) * 1e6
            out[f"durable_{op}_mb_s"] = nbytes / sum(times) / 1e6 if times else 0.0
        return out


def _stored_bytes(kv: np.ndarray) -> int:
    """Bytes of encode_block(kv): magic, version, dtype string, ndim, shape,
    payload length, CRC, payload (the layout in :mod:`.kvstore`)."""
    return 4 + 1 + 1 + len(kv.dtype.str) + 1 + 4 * kv.ndim + 8 + 4 + kv.nbytes


def _write_bytes() -> int | None:
    """Bytes this process has caused to be written to storage so far (Linux
    ``/proc/self/io`` ``write_bytes``: page-cache pages it dirtied, through
    ``write`` or a mapping); None where that is not readable."""
    try:
        with open("/proc/self/io", encoding="ascii") as f:
            for line in f:
                if line.startswith("write_bytes:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def dir_bytes(path: str) -> int:
    """Bytes on disk under ``path`` (allocated blocks, so a preallocated log
    segment counts in full)."""
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
            except FileNotFoundError:
                pass
    return total


def run_workload(w: Workload, cfg: BenchConfig, *, scheduler: str = "continuous",
                 prefix: str = "off", cache: Cache | None = None, batched: bool = True,
                 on_tokens: Callable[[int], None] | None = None, graceful: bool = True,
                 on_done: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Run the chats once; return the measurements (wall clock).

    :param scheduler: ``"continuous"`` or ``"static"``.
    :param prefix: ``"off"``, ``"memory"`` or ``"durable"`` (needs ``cache``).
    :param cache: the durablekv Cache of the durable tier.
    :param graceful: with ``prefix="durable"``, spill the cached blocks at the
        end (a graceful shutdown); False leaves the async writer's queue as it is.
    :param on_done: called with the result before the graceful shutdown (the
        kill variant reports and is killed there).
    """
    model = TinyTransformer(vocab_size=cfg.vocab_size, num_layers=cfg.num_layers,
                            num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads,
                            head_dim=cfg.head_dim, seed=w.seed, batched=batched)
    store = TimedKVBlockStore(cache) if prefix == "durable" else None
    pool = model.make_pool(cfg.num_blocks, cfg.block_size, enable_prefix_caching=prefix != "off",
                           store=store)
    cls = StaticScheduler if scheduler == "static" else ContinuousScheduler
    sched = cls(pool, max_num_seqs=cfg.max_num_seqs,
                max_num_batched_tokens=cfg.max_num_batched_tokens)
    clock = time.perf_counter
    engine = LLMEngine(model, pool, sched, clock=clock)
    chats = make_chats(w, cfg.vocab_size)
    ready = deque(chats)
    in_flight = 0
    seqs = []
    usage = []
    start = clock()
    while ready or in_flight:
        while ready and in_flight < w.concurrency:
            chat = ready.popleft()
            seqs.append((chat, engine.add_request(chat.next_request(clock()))))
            in_flight += 1
        finished = engine.step()
        usage.append(pool.stats().usage)
        for seq in finished:
            in_flight -= 1
            chat = chats[seq.request.request_id[0]]
            chat.history = list(seq.token_ids)
            chat.turn += 1
            if chat.turn < w.turns:
                ready.append(chat)
            if on_tokens:
                on_tokens(len(seq.output_token_ids))
    wall = clock() - start
    ttft = [s.first_token_time - s.request.arrival_time for _, s in seqs]
    tpot = [(s.finish_time - s.first_token_time) / (len(s.output_token_ids) - 1)
            for _, s in seqs if len(s.output_token_ids) > 1]
    prompt_tokens = sum(s.num_prompt_tokens for _, s in seqs)
    mem = sum(s.cached_tokens_memory for _, s in seqs)
    dur = sum(s.cached_tokens_durable for _, s in seqs)
    out_tokens = sum(len(s.output_token_ids) for _, s in seqs)
    digest = hashlib.sha256()
    for _, s in sorted(seqs, key=lambda cs: cs[1].request.request_id):
        digest.update(np.asarray(s.output_token_ids, dtype=np.int64).tobytes())
    st = pool.stats()
    res = {
        "tokens_per_s": out_tokens / wall,
        "ttft_p50_s": _pct(ttft, 0.5), "ttft_p99_s": _pct(ttft, 0.99),
        "tpot_p50_s": _pct(tpot, 0.5), "tpot_p99_s": _pct(tpot, 0.99),
        "prefix_hit_rate": (mem + dur) / prompt_tokens,
        "prefix_hit_rate_memory": mem / prompt_tokens,
        "prefix_hit_rate_durable": dur / prompt_tokens,
        "requests": len(seqs), "output_tokens": out_tokens, "prompt_tokens": prompt_tokens,
        "tokens_computed": model.tokens_computed, "steps": engine.num_steps,
        "mean_batch_size": float(np.mean(engine.batch_sizes)) if engine.batch_sizes else 0.0,
        "preemptions": st.preemptions, "evictions": st.evictions,
        "spilled_blocks": st.spilled_blocks, "written_blocks": st.written_blocks,
        "write_drops": st.write_drops,
        "kv_usage_mean": float(np.mean(usage)) if usage else 0.0,
        "kv_usage_max": float(np.max(usage)) if usage else 0.0,
        "wall_s": wall, "outputs_sha256": digest.hexdigest(),
    }
    if store is not None:
        res.update(store.report())
        res["prefix_hit_rate_reused"] = store.reused * cfg.block_size / prompt_tokens
        res["write_queue_at_end"] = st.write_queue
    if on_done:
        on_done(res)
    if store is not None and graceful:
        pool.spill_cached()          # graceful shutdown: the durable tier keeps every block
        res["written_blocks"] = pool.stats().written_blocks
    return res


def _child_main() -> None:
    """The child process of a restart run: read its job (JSON) from stdin,
    open the Cache (timed: recovery included), run the workload, print the
    result as one JSON line. A ``"kill": true`` job prints before the graceful
    shutdown and then waits to be killed."""
    job = json.loads(sys.stdin.readline())
    w, cfg = Workload(**job["workload"]), BenchConfig(**job["config"])
    written0 = _write_bytes()
    t0 = time.perf_counter()
    cache = Cache(job["cache_dir"], name="llm-bench")
    open_s = time.perf_counter() - t0

    def report(res: dict[str, Any]) -> None:
        written = _write_bytes()
        res["write_bytes"] = None if written is None or written0 is None else written - written0
        res["open_s"] = open_s
        print(json.dumps(res), flush=True)

    if job["kill"]:
        run_workload(w, cfg, prefix="durable", cache=cache, graceful=False, on_done=report)
        sys.stdin.read()             # SIGKILL comes here, with the writer's queue as it is
        os._exit(3)
    with cache:
        res = run_workload(w, cfg, prefix="durable", cache=cache)
    report(res)                      # after the close: its flush to the page store counts


def run_child(w: Workload, cfg: BenchConfig, cache_dir: str, *, kill: bool = False,
              timeout: float = 600.0) -> dict[str, Any]:
    """Run ``w`` with the durable tier on ``cache_dir`` in a new Python process
    (see :func:`_child_main`); with ``kill``, SIGKILL it the moment it reports.

    :raises RuntimeError: the child failed, or was silent for ``timeout`` s.
    """
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    proc = subprocess.Popen(
        [sys.executable, "-c", "from durablekv.llm.bench import _child_main; _child_main()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=env)
    job = {"workload": asdict(w), "config": asdict(cfg), "cache_dir": cache_dir, "kill": kill}
    try:
        proc.stdin.write(json.dumps(job) + "\n")
        proc.stdin.flush()
        line = _readline_within(proc, timeout)
        if kill:
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=60)
            killed = proc.returncode == -signal.SIGKILL
        else:
            proc.stdin.close()
            proc.wait(timeout=timeout)
            killed = False
        err = proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if not line or (not kill and proc.returncode != 0) or (kill and not killed):
        raise RuntimeError(f"llm-bench child on {cache_dir} failed (exit {proc.returncode}): "
                           f"{err[-2000:]}")
    res = json.loads(line)
    res["store_bytes"] = dir_bytes(cache_dir)
    return res


def _readline_within(proc: subprocess.Popen, timeout: float) -> str:
    """One line of the child's stdout, or "" when it exits or ``timeout`` s pass."""
    import threading

    timer = threading.Timer(timeout, proc.kill)
    timer.start()
    try:
        return proc.stdout.readline()
    finally:
        timer.cancel()


def batching_micro(cfg: BenchConfig, *, batch_sizes: list[int], steps: int, context: int,
                   repeats: int, seed: int = 0) -> list[dict[str, Any]]:
    """Decode steps alone, at a fixed batch size: one matmul per layer for the
    whole batch vs one per sequence (the same tokens, positions and KV).

    Each sequence first gets a ``context``-token prefill; then ``steps`` decode
    steps run in each mode, alternating, ``repeats`` times.
    """
    model = TinyTransformer(vocab_size=cfg.vocab_size, num_layers=cfg.num_layers,
                            num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads,
                            head_dim=cfg.head_dim, seed=seed)
    rng = np.random.default_rng(seed)
    out = []
    for batch in batch_sizes:
        per_seq_blocks = -(-(context + steps) // cfg.block_size)
        pool = model.make_pool(batch * per_seq_blocks, cfg.block_size,
                               enable_prefix_caching=False)
        for i in range(batch):
            prompt = rng.integers(0, cfg.vocab_size, context).tolist()
            pool.add_sequence(i, prompt)
            pool.allocate_slots(i, 0, context + steps)
            model.forward(pool, [Segment(i, prompt, 0)])
        token = [int(rng.integers(0, cfg.vocab_size))]
        rates: dict[bool, list[float]] = {True: [], False: []}
        for _ in range(repeats):
            for batched in (False, True):
                model.batched = batched
                t0 = time.perf_counter()
                for step in range(steps):
                    model.forward(pool, [Segment(i, token, context + step) for i in range(batch)])
                rates[batched].append(batch * steps / (time.perf_counter() - t0))
        gains = [b / p for b, p in zip(rates[True], rates[False])]
        out.append({"batch_size": batch,
                    "batched_tokens_per_s": statistics.median(rates[True]),
                    "per_sequence_tokens_per_s": statistics.median(rates[False]),
                    "gain": {"median": statistics.median(gains), "min": min(gains),
                             "max": max(gains)}})
    return out


#: the runs in a new process on new requests (see the module docstring)
RESTART_KEYS = ("restart_cold", "prefix_after_restart", "prefix_after_kill")

_TIMED = ("tokens_per_s", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s", "wall_s")


def _summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Median of each timed value over the repeats (with min/max), the rest from run 1."""
    out = dict(runs[0])
    out["repeats"] = len(runs)
    for key in _TIMED:
        vals = [r[key] for r in runs]
        out[key] = statistics.median(vals)
        out[key + "_min"], out[key + "_max"] = min(vals), max(vals)
    return out


def _ratio(runs_a: list[dict], runs_b: list[dict], key: str = "tokens_per_s") -> dict[str, float]:
    """a/b per repeat (paired: the same repeat ran both), median and spread."""
    vals = [a[key] / b[key] for a, b in zip(runs_a, runs_b)]
    return {"median": statistics.median(vals), "min": min(vals), "max": max(vals)}


def run_bench(*, quick: bool = False, repeats: int | None = None, spread: float | None = None,
              seed: int = 0, workdir: str | None = None, progress: bool = False,
              plots_dir: str | None = None) -> dict[str, Any]:
    """Run every configuration (see the module docstring); return the report."""
    from tqdm import tqdm

    if quick:
        w = Workload(conversations=8, turns=2, system_prompts=2, system_len=32, user_len=12,
                     output_len=12, concurrency=4, seed=seed)
        cfg = BenchConfig(vocab_size=256, num_heads=2, num_kv_heads=1, head_dim=8,
                          block_size=8, num_blocks=40, max_num_seqs=8,
                          max_num_batched_tokens=256)
        repeats = repeats or 1
        spreads, loads = [0.0, 0.9], [2, 4]
    else:
        w = Workload(seed=seed)
        cfg = BenchConfig()
        repeats = repeats or 3
        spreads, loads = [0.0, 0.25, 0.5, 0.75, 1.0], [1, 2, 4, 8, 16]
    if spread is not None:
        w = replace(w, spread=spread)
    new_w = replace(w, user_seed=w.seed + 1)   # new traffic, the same system prompts
    plan: list[tuple[str, Workload, dict]] = []
    mem = {"prefix": "memory"}
    for _ in range(repeats):          # interleaved: machine noise hits every configuration
        plan += [("static", w, {"scheduler": "static", **mem}), ("continuous", w, mem),
                 ("per_seq", w, {"batched": False, **mem}), ("prefix_off", w, {}),
                 ("prefix_memory", w, mem),
                 ("prefix_durable", w, {"prefix": "durable"}),
                 ("prefix_after_restart", new_w, {"child": "durable"}),
                 ("durable_killed", w, {"child": "kill"}),
                 ("prefix_after_kill", new_w, {"child": "kill"}),
                 ("restart_cold", new_w, {"child": "cold"})]
        for s in spreads:
            sw = replace(w, spread=s)
            plan += [(f"spread:{s}:static", sw, {"scheduler": "static", **mem}),
                     (f"spread:{s}:continuous", sw, mem)]
        for c in loads:
            lw = replace(w, concurrency=c)
            plan += [(f"load:{c}:static", lw, {"scheduler": "static", **mem}),
                     (f"load:{c}:continuous", lw, mem)]
    total = sum(output_tokens(pw, cfg.vocab_size) for _, pw, _ in plan)
    tmp = tempfile.mkdtemp(prefix="durablekv-llm-bench-", dir=workdir)
    results: dict[str, list[dict]] = {}
    bar = tqdm(total=total, unit="tok", desc="llm-bench", disable=not progress, file=sys.stderr)
    try:
        dirs: dict[str, str] = {}   # the Cache each restart opens, by what left it
        for i, (name, pw, kw) in enumerate(plan):
            bar.set_postfix_str(name)
            if kw.get("prefix") == "durable":
                dirs["durable"] = os.path.join(tmp, f"kv-{i}")
                written0 = _write_bytes()
                with Cache(dirs["durable"], name="llm-bench") as cache:
                    res = run_workload(pw, cfg, cache=cache, on_tokens=bar.update, **kw)
                written = _write_bytes()
                res["write_bytes"] = (None if written is None or written0 is None
                                      else written - written0)   # the close's flush included
                res["store_bytes"] = dir_bytes(dirs["durable"])
            elif "child" in kw:
                if name in ("durable_killed", "restart_cold"):   # each starts on a new Cache
                    dirs[kw["child"]] = os.path.join(tmp, f"kv-{i}")
                res = run_child(pw, cfg, dirs[kw["child"]], kill=name == "durable_killed")
                bar.update(res["output_tokens"])
            else:
                res = run_workload(pw, cfg, on_tokens=bar.update, **kw)
            results.setdefault(name, []).append(res)
    finally:
        bar.close()
        shutil.rmtree(tmp, ignore_errors=True)

    main_keys = ("static", "continuous", "prefix_off", "prefix_memory", "prefix_durable",
                 "durable_killed") + RESTART_KEYS
    report: dict[str, Any] = {k: _summarize(results[k]) for k in main_keys}
    report["batching"] = {
        "batched": _summarize(results["continuous"]),
        "per_sequence": _summarize(results["per_seq"]),
        "gain": _ratio(results["continuous"], results["per_seq"]),
    }
    report["batching"]["decode_micro"] = batching_micro(
        cfg, batch_sizes=[1, 4, 16] if not quick else [1, 4], steps=8 if quick else 32,
        context=cfg.block_size * 4, repeats=repeats, seed=seed)
    report["scheduling_gain"] = _ratio(results["continuous"], results["static"])
    report["prefix_gain"] = {
        "memory_vs_off": _ratio(results["prefix_memory"], results["prefix_off"]),
        "durable_vs_off": _ratio(results["prefix_durable"], results["prefix_off"]),
    }
    report["restart_gain"] = {
        f"{k}_vs_cold": {m: _ratio(results[k], results["restart_cold"], m)
                         for m in ("tokens_per_s", "ttft_p50_s")}
        for k in ("prefix_after_restart", "prefix_after_kill")}
    report["spread_sweep"] = [
        {"spread": s, "static": _summarize(results[f"spread:{s}:static"]),
         "continuous": _summarize(results[f"spread:{s}:continuous"]),
         "gain": _ratio(results[f"spread:{s}:continuous"], results[f"spread:{s}:static"])}
        for s in spreads]
    report["load_sweep"] = [
        {"concurrency": c, "static": _summarize(results[f"load:{c}:static"]),
         "continuous": _summarize(results[f"load:{c}:continuous"])} for c in loads]
    digests = {r["outputs_sha256"] for k in ("static", "continuous", "per_seq", "prefix_off",
                                             "prefix_memory", "prefix_durable", "durable_killed")
               for r in results[k]}
    after = {r["outputs_sha256"] for k in RESTART_KEYS for r in results[k]}
    report["outputs_identical"] = len(digests) == 1 and len(after) == 1
    report["workload"] = asdict(w)
    report["restart_workload"] = asdict(new_w)
    report["config"] = asdict(cfg)
    report["quick"] = quick
    if plots_dir:
        report["plots"] = plot(report, plots_dir)
    return report


def plot(report: dict[str, Any], directory: str) -> list[str]:
    """Throughput and TTFT vs load; hit rate by tier; gain vs output-length spread (PNGs)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(directory, exist_ok=True)
    paths = []
    loads = report["load_sweep"]
    xs = [p["concurrency"] for p in loads]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for sched, style in (("static", "o--"), ("continuous", "s-")):
        a.plot(xs, [p[sched]["tokens_per_s"] for p in loads], style, label=sched)
        b.plot(xs, [p[sched]["ttft_p50_s"] * 1e3 for p in loads], style, label=f"{sched} p50")
        b.plot(xs, [p[sched]["ttft_p99_s"] * 1e3 for p in loads], style, alpha=0.5,
               label=f"{sched} p99")
    a.set(xlabel="concurrent chats", ylabel="generated tokens/s", title="Throughput vs load")
    b.set(xlabel="concurrent chats", ylabel="TTFT (ms)", title="TTFT vs load", yscale="log")
    for ax in (a, b):
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    paths.append(os.path.join(directory, "llm_load.png"))
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    keys = ("prefix_off", "prefix_memory", "prefix_durable") + RESTART_KEYS
    fig, ax = plt.subplots(figsize=(8, 4))
    mem = [report[k]["prefix_hit_rate_memory"] for k in keys]
    dur = [report[k]["prefix_hit_rate_durable"] for k in keys]
    labels = ["off", "memory", "memory +\ndurablekv", "restart:\ncold", "restart:\ngraceful",
              "restart:\nkill -9"]
    ax.bar(labels, mem, label="memory (block pool)")
    ax.bar(labels, dur, bottom=mem, label="durable (durablekv Cache)")
    ax.set(ylabel="prompt tokens served from cache", ylim=(0, 1), title="Prefix hit rate by tier")
    ax.legend()
    fig.tight_layout()
    paths.append(os.path.join(directory, "llm_hit_rate.png"))
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    sw = report["spread_sweep"]
    fig, ax = plt.subplots(figsize=(6.5, 4))
    ax.errorbar([p["spread"] for p in sw], [p["gain"]["median"] for p in sw],
                yerr=[[p["gain"]["median"] - p["gain"]["min"] for p in sw],
                      [p["gain"]["max"] - p["gain"]["median"] for p in sw]], fmt="o-")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set(xlabel="output length spread (0: all equal)",
           ylabel="continuous / static tokens/s", title="Scheduling gain vs output-length spread")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    paths.append(os.path.join(directory, "llm_spread.png"))
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths


def _span(x: dict, key: str, scale: float = 1.0, fmt: str = "{:.0f}") -> str:
    """``x[key]`` (a median) with its min..max when the run repeated."""
    if x.get("repeats", 1) == 1:
        return fmt.format(x[key] * scale)
    return (fmt.format(x[key] * scale) + " (" + fmt.format(x[key + "_min"] * scale) + ".."
            + fmt.format(x[key + "_max"] * scale) + ")")


def _gain(g: dict) -> str:
    return f"{g['median']:.2f}x ({g['min']:.2f}..{g['max']:.2f})"


def _hit(x: dict) -> str:
    return (f"{x['prefix_hit_rate']:.1%} ({x['prefix_hit_rate_memory']:.1%} + "
            f"{x['prefix_hit_rate_durable']:.1%})")


def render_markdown(r: dict[str, Any]) -> str:
    """The report's tables in Markdown (docs/llm.md quotes this output)."""
    lines = ["| configuration | tokens/s | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | "
             "TPOT p99 ms | hit rate (memory + durable) | preemptions | KV use mean/max |",
             "|---|---|---|---|---|---|---|---|---|"]
    for k in ("static", "continuous", "prefix_off", "prefix_memory", "prefix_durable"):
        x = r[k]
        lines.append(
            f"| `{k}` | {_span(x, 'tokens_per_s')} | {_span(x, 'ttft_p50_s', 1e3, '{:.1f}')} | "
            f"{_span(x, 'ttft_p99_s', 1e3, '{:.1f}')} | {_span(x, 'tpot_p50_s', 1e3, '{:.2f}')} | "
            f"{_span(x, 'tpot_p99_s', 1e3, '{:.2f}')} | {_hit(x)} | "
            f"{x['preemptions']} | {x['kv_usage_mean']:.0%} / {x['kv_usage_max']:.0%} |")
    lines += ["", "Restarts, each a new process serving new requests (same system prompts):", "",
              "| restart | Cache open ms (recovery) | tokens/s | TTFT p50 ms | TTFT p99 ms | "
              "hit rate (memory + durable) | from before the restart | blocks found / reused |",
              "|---|---|---|---|---|---|---|---|"]
    for k in RESTART_KEYS:
        x = r[k]
        lines.append(f"| `{k}` | {x['open_s'] * 1e3:.0f} | {_span(x, 'tokens_per_s')} | "
                     f"{_span(x, 'ttft_p50_s', 1e3, '{:.1f}')} | "
                     f"{_span(x, 'ttft_p99_s', 1e3, '{:.1f}')} | {_hit(x)} | "
                     f"{x['prefix_hit_rate_reused']:.1%} | {x['blocks_at_open']} / "
                     f"{x['blocks_reused']} |")
    lines += ["", "The durable tier's I/O in each run (latency and MB/s inside "
              "`KVBlockStore.put`/`get`, encode/decode included; bytes written from "
              "`/proc/self/io`; store size on disk after the run):", "",
              "| run | blocks written | dropped | queued at end | stored bytes/block | "
              "bytes written/block | put p50/p99 us | put MB/s | get p50/p99 us | get MB/s | "
              "store MB |", "|---|---:|---:|---:|---:|---:|---|---:|---|---:|---:|"]
    for k in ("prefix_durable", "durable_killed") + RESTART_KEYS:
        x = r[k]
        wb = x.get("write_bytes")
        per = (f"{wb / x['written_blocks']:.0f}" if wb is not None and x["written_blocks"]
               else "n/a")
        lines.append(
            f"| `{k}` | {x['written_blocks']} | {x['write_drops']} | {x['write_queue_at_end']} | "
            f"{x['block_bytes']} | {per} | {x['durable_put_p50_us']:.0f} / "
            f"{x['durable_put_p99_us']:.0f} | {x['durable_put_mb_s']:.0f} | "
            f"{x['durable_get_p50_us']:.0f} / {x['durable_get_p99_us']:.0f} | "
            f"{x['durable_get_mb_s']:.0f} | {x['store_bytes'] / 1e6:.1f} |")
    lines += ["", "| ratio (median of per-repeat ratios, min..max) | value |", "|---|---|",
              f"| batching: one matmul for the batch / one per sequence (whole workload), "
              f"tokens/s | {_gain(r['batching']['gain'])} |"]
    for p in r["batching"]["decode_micro"]:
        lines.append(f"| batching, decode steps only, batch {p['batch_size']}, tokens/s | "
                     f"{_gain(p['gain'])} |")
    lines.append(f"| scheduling: continuous / static, tokens/s | {_gain(r['scheduling_gain'])} |")
    for name in ("memory_vs_off", "durable_vs_off"):
        lines.append(f"| prefix caching: {name.replace('_', ' ')}, tokens/s | "
                     f"{_gain(r['prefix_gain'][name])} |")
    for name, g in r["restart_gain"].items():
        what = name.replace("prefix_", "").replace("_vs_cold", "").replace("_", " ")
        lines.append(f"| {what} / cold restart, tokens/s | {_gain(g['tokens_per_s'])} |")
        lines.append(f"| {what} / cold restart, TTFT p50 | {_gain(g['ttft_p50_s'])} |")
    for p in r["spread_sweep"]:
        lines.append(f"| continuous / static at output spread {p['spread']:.2f}, tokens/s | "
                     f"{_gain(p['gain'])} |")
    ttft = [f"{p['concurrency']}: {p['static']['ttft_p50_s'] * 1e3:.0f} / "
            f"{p['continuous']['ttft_p50_s'] * 1e3:.0f}" for p in r["load_sweep"]]
    lines += ["", "TTFT p50 ms static / continuous by concurrent chats: " + "; ".join(ttft) + ".",
              f"Identical tokens in every configuration: {r['outputs_identical']}."]
    return "\n".join(lines) + "\n"


def _compare(g: dict, more: str, less: str) -> str:
    """Words for a ratio with its spread: ``within noise`` when min..max spans 1."""
    if g["min"] == g["max"]:
        return f"{_gain(g)}, one repeat: no spread to tell it from noise"
    if g["min"] <= 1.0 <= g["max"]:
        return f"within noise ({_gain(g)}: the repeats fall on both sides of 1)"
    return f"{more if g['median'] > 1 else less} ({_gain(g)})"


def render_findings(r: dict[str, Any]) -> str:
    """What the run shows, in words, from the numbers of ``r`` alone: a
    difference whose repeats fall on both sides of 1.0 is called noise."""
    pg, rg, sg = r["prefix_gain"], r["restart_gain"], r["scheduling_gain"]
    d, off = r["prefix_durable"], r["prefix_off"]
    cold, warm, kill = (r[k] for k in RESTART_KEYS)
    killed = r["durable_killed"]
    out = [
        f"- **Prefix caching.** Memory alone serves {r['prefix_memory']['prefix_hit_rate']:.0%} "
        f"of prompt tokens; with the durable tier {d['prefix_hit_rate']:.0%} "
        f"({d['prefix_hit_rate_memory']:.0%} memory + {d['prefix_hit_rate_durable']:.0%} "
        f"durable). Tokens/s against prefix caching off: memory only "
        f"{_compare(pg['memory_vs_off'], 'higher', 'lower')}, with the durable tier "
        f"{_compare(pg['durable_vs_off'], 'higher', 'lower')}. TTFT p50: "
        f"{off['ttft_p50_s'] * 1e3:.1f} ms off, {d['ttft_p50_s'] * 1e3:.1f} ms durable.",
        f"- **Restart on new traffic.** A new process serving new chats over the same system "
        f"prompts serves {warm['prefix_hit_rate_reused']:.1%} of its prompt tokens from "
        f"blocks computed before a graceful restart ({warm['blocks_reused']} blocks of the "
        f"{warm['blocks_at_open']} it found) and {kill['prefix_hit_rate_reused']:.1%} after "
        f"kill -9 ({kill['blocks_reused']} of {kill['blocks_at_open']}); its whole durable "
        f"hit rate, blocks of its own run included, is {warm['prefix_hit_rate_durable']:.1%}, "
        f"{kill['prefix_hit_rate_durable']:.1%}, and {cold['prefix_hit_rate_durable']:.1%} "
        f"after a cold restart. "
        f"Against the cold restart, TTFT p50 after the graceful restart is "
        f"{_compare(rg['prefix_after_restart_vs_cold']['ttft_p50_s'], 'longer', 'shorter')}, "
        f"after kill -9 "
        f"{_compare(rg['prefix_after_kill_vs_cold']['ttft_p50_s'], 'longer', 'shorter')}; "
        f"tokens/s after the graceful restart "
        f"{_compare(rg['prefix_after_restart_vs_cold']['tokens_per_s'], 'higher', 'lower')}, "
        f"after kill -9 "
        f"{_compare(rg['prefix_after_kill_vs_cold']['tokens_per_s'], 'higher', 'lower')}.",
        f"- **kill -9.** The killed run had written {killed['written_blocks']} blocks as they "
        f"filled ({killed['write_drops']} dropped, {killed['write_queue_at_end']} still queued "
        f"when it reported, lost unless the writer reached them before the kill); "
        f"the graceful run wrote {d['written_blocks']}, its spill at shutdown included. "
        f"Opening the killed run's Cache, recovery included, took "
        f"{kill['open_s'] * 1e3:.0f} ms ({warm['open_s'] * 1e3:.0f} ms after a clean close).",
        f"- **Scheduling.** Continuous batching against static on the same requests: TTFT p50 "
        f"{r['static']['ttft_p50_s'] * 1e3:.1f} ms static, "
        f"{r['continuous']['ttft_p50_s'] * 1e3:.1f} ms continuous; tokens/s "
        f"{_compare(sg, 'higher', 'lower')}.",
        f"- **Tokens.** Identical in every configuration, restarts included: "
        f"{r['outputs_identical']}.",
    ]
    return "\n".join(out) + "\n"


def render_docs(r: dict[str, Any]) -> str:
    """The tables and the findings, as docs/llm.md holds them (``python -m bench.llm_docs``)."""
    return render_markdown(r) + "\nWhat this run shows (generated from its numbers):\n\n" + \
        render_findings(r)


def _print_report(r: dict[str, Any], out=None) -> None:
    out = out or sys.stdout

    def row(name: str, x: dict) -> None:
        print(f"  {name:22s} {x['tokens_per_s']:9.0f} tok/s  TTFT p50 {x['ttft_p50_s']*1e3:8.1f}"
              f" ms p99 {x['ttft_p99_s']*1e3:8.1f} ms  TPOT p50 {x['tpot_p50_s']*1e3:6.2f} ms"
              f" p99 {x['tpot_p99_s']*1e3:6.2f} ms  hit {x['prefix_hit_rate']:5.1%}"
              f" (mem {x['prefix_hit_rate_memory']:5.1%}, durable"
              f" {x['prefix_hit_rate_durable']:5.1%})  preempt {x['preemptions']:3d}"
              f"  KV use {x['kv_usage_mean']:4.0%}/{x['kv_usage_max']:4.0%}", file=out)

    def gain(g: dict) -> str:
        return f"{g['median']:.2f}x (min {g['min']:.2f}, max {g['max']:.2f})"

    reps = r["static"]["repeats"]
    print(f"llm-bench ({'quick' if r['quick'] else 'full'}; medians of {reps} run(s))", file=out)
    for k in ("static", "continuous", "prefix_off", "prefix_memory", "prefix_durable"):
        row(k, r[k])
    print("  restarts (new process, new requests):", file=out)
    for k in RESTART_KEYS:
        row(k, r[k])
    print(f"  batching gain (one matmul for the batch vs one per sequence): "
          f"{gain(r['batching']['gain'])}", file=out)
    for p in r["batching"]["decode_micro"]:
        print(f"    decode only, batch {p['batch_size']:2d}: batched "
              f"{p['batched_tokens_per_s']:7.0f} tok/s, per sequence "
              f"{p['per_sequence_tokens_per_s']:7.0f} tok/s: {gain(p['gain'])}", file=out)
    print(f"  scheduling gain (continuous vs static, same requests): "
          f"{gain(r['scheduling_gain'])}", file=out)
    for name, g in r["prefix_gain"].items():
        print(f"  prefix caching {name.replace('_', ' ')}: {gain(g)}", file=out)
    for name, g in r["restart_gain"].items():
        print(f"  {name.replace('_', ' ')}: tokens/s {gain(g['tokens_per_s'])}, "
              f"TTFT p50 {gain(g['ttft_p50_s'])}", file=out)
    k = r["durable_killed"]
    print(f"  killed run: {k['written_blocks']} blocks written, {k['write_drops']} dropped, "
          f"{k['write_queue_at_end']} queued when killed", file=out)
    print("  output-length spread sweep, continuous/static tokens/s:", file=out)
    for p in r["spread_sweep"]:
        print(f"    spread {p['spread']:.2f}: {gain(p['gain'])}", file=out)
    print("  load sweep (concurrent chats): tokens/s static / continuous, TTFT p50 ms", file=out)
    for p in r["load_sweep"]:
        s, c = p["static"], p["continuous"]
        print(f"    {p['concurrency']:3d}: {s['tokens_per_s']:7.0f} / {c['tokens_per_s']:7.0f}"
              f"   {s['ttft_p50_s']*1e3:7.1f} / {c['ttft_p50_s']*1e3:7.1f}", file=out)
    print(f"  identical tokens in every configuration: {r['outputs_identical']}", file=out)


def main(args: argparse.Namespace) -> int:
    """The ``durablekv llm-bench`` command (arguments from :mod:`durablekv.cli`)."""
    progress = sys.stderr.isatty() if args.progress is None else args.progress
    plots = args.plots   # only where asked: a run never overwrites committed plots by default
    # Refuse what would fail after minutes of work, before any of it.
    if args.plots is not None and importlib.util.find_spec("matplotlib") is None:
        print(f"durablekv: llm-bench --plots {args.plots} needs matplotlib, which is not "
              "installed: pip install '.[bench]', or leave out --plots", file=sys.stderr)
        return 2
    for what, path in (("--json", args.json and os.path.dirname(os.path.abspath(args.json))),
                       ("--plots", plots)):
        if path and not (os.path.isdir(path) and os.access(path, os.W_OK)):
            if what == "--plots" and not os.path.exists(path):
                continue  # made by plot()
            print(f"durablekv: llm-bench {what}: {path!r} is not a writable directory; "
                  f"pass {what} a path in one", file=sys.stderr)
            return 2
    if args.quick:
        print("durablekv: llm-bench --quick: one tiny run of each configuration, to check that "
              "everything runs; its ratios are noise (docs/llm.md has a full run's)",
              file=sys.stderr)
    report = run_bench(quick=args.quick, repeats=args.repeats, spread=args.output_spread,
                       seed=args.seed, progress=progress, plots_dir=plots)
    _print_report(report)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2, sort_keys=True)
            f.write("\n")
    return 0 if report["outputs_identical"] else 1
