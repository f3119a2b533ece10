"""One soak against one server: a clean greedy run, then `duration` seconds of concurrent
clients with faults injected at random times, then the end-of-run checks. Returns a plain dict
(`soak_server`) that `bench.soak.judge` turns into a verdict.

Tasks during the load, all on one asyncio loop: `concurrency` clients, each sending one
request after another (`workload.draw_spec`); the fault injector (`inject_faults`); an
integrity check every `integrity_interval` seconds; an RSS sample every second.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import time
from dataclasses import asdict, dataclass
from typing import Any, Optional

import httpx
import openai

from bench.soak import clients, workload
from bench.soak.server import SoakServer, summarize_stats

#: Fault kinds injected, in turn (`engine.server.debug`).
FAULT_KINDS = ("step_raises", "engine_thread_dies")


@dataclass(frozen=True)
class SoakConfig:
    """The soak's settings (the `python -m bench.soak` flags)."""

    duration: float
    concurrency: int = 4
    num_kv_blocks: int = workload.MIN_KV_BLOCKS
    fault_interval: float = 10.0
    request_timeout: float = 60.0
    num_references: int = 8
    warmup: float = 10.0
    rss_growth_mib: float = 64.0
    integrity_interval: float = 5.0
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("duration", "fault_interval", "request_timeout", "integrity_interval",
                     "rss_growth_mib"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}: expected a number > 0, got {getattr(self, name)!r}")
        for name in ("concurrency", "num_kv_blocks", "num_references"):
            if not getattr(self, name) >= 1:
                raise ValueError(f"{name}: expected an integer >= 1, got "
                                 f"{getattr(self, name)!r}")
        if self.num_kv_blocks < workload.MIN_KV_BLOCKS:
            raise ValueError(f"num_kv_blocks: expected at least {workload.MIN_KV_BLOCKS} (the "
                             f"largest soak request), got {self.num_kv_blocks}")
        if not 0 <= self.warmup < self.duration:
            raise ValueError(f"warmup: expected seconds in [0, duration={self.duration}), got "
                             f"{self.warmup!r}")


async def soak_server(server: SoakServer, cfg: SoakConfig, seed: int) -> dict[str, Any]:
    """The whole soak of one started server; every request's spec and result, the faults, the
    checks and the RSS samples."""
    # The clients' own timeouts are longer than the per-request one, which `clients.send` keeps.
    timeout = cfg.request_timeout + 10.0
    limits = httpx.Limits(max_connections=4 * cfg.concurrency + 8)
    async with httpx.AsyncClient(base_url=server.base_url, timeout=timeout,
                                 limits=limits) as http, \
            openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="soak", max_retries=0,
                               timeout=timeout) as oai:
        model = (await http.get("/v1/models")).json()["data"][0]["id"]
        references = workload.reference_bodies(cfg.num_references, seed)
        t0 = time.time()
        clean = await clean_run(references, model, http, oai, cfg)
        record: dict[str, Any] = {"mode": server.mode, "command": server.command,
                                  "model": model, "clean": clean, "results": [],
                                  "faults": [], "integrity": [], "rss": [],
                                  "clean_s": round(time.time() - t0, 1)}
        if any(t is None for t in clean):
            record["aborted"] = "the clean run did not answer every greedy request"
            return record
        await _load(server, cfg, seed, references, model, http, oai, record)
        t0 = time.time()
        await _final_checks(server, cfg, references, model, http, oai, record)
        record["final_s"] = round(time.time() - t0, 1)
    return record


async def clean_run(references: list[tuple[str, dict[str, Any]]], model: str,
                    http: httpx.AsyncClient, oai: openai.AsyncOpenAI,
                    cfg: SoakConfig) -> list[Optional[str]]:
    """The greedy answers of a fault-free run (all references at once); None where one failed."""
    specs = [workload.Spec("greedy", api, "httpx", {**body, "model": model}, reference=i)
             for i, (api, body) in enumerate(references)]
    results = await asyncio.gather(*(clients.send(s, http, oai, cfg.request_timeout)
                                     for s in specs))
    return [r.texts.get(0) if r.outcome == "ok" else None for r in results]


async def _load(server: SoakServer, cfg: SoakConfig, seed: int,
                references: list[tuple[str, dict[str, Any]]], model: str,
                http: httpx.AsyncClient, oai: openai.AsyncOpenAI,
                record: dict[str, Any]) -> None:
    start = time.time()
    deadline = start + cfg.duration
    record["start"] = start
    record["stats_start"] = await _get_json(http, "GET", "/internal/stats")
    stop = asyncio.Event()
    background = [asyncio.create_task(_sample_rss(server, record["rss"], stop)),
                  asyncio.create_task(_check_integrity_every(http, cfg, record["integrity"],
                                                             stop))]
    clients_done = [asyncio.create_task(_client(random.Random(seed * 1000 + i), deadline,
                                                references, model, http, oai, cfg,
                                                record["results"]))
                    for i in range(cfg.concurrency)]
    faults = asyncio.create_task(inject_faults(random.Random(seed * 1000 - 1), deadline, http,
                                               oai, cfg, record))
    await asyncio.gather(*clients_done, faults)
    record["load_end"] = time.time()
    stop.set()
    await asyncio.gather(*background)


async def _client(rng: random.Random, deadline: float,
                  references: list[tuple[str, dict[str, Any]]], model: str,
                  http: httpx.AsyncClient, oai: openai.AsyncOpenAI, cfg: SoakConfig,
                  out: list[dict[str, Any]]) -> None:
    while time.time() < deadline:
        spec = workload.draw_spec(rng, references, model)
        result = await clients.send(spec, http, oai, cfg.request_timeout)
        out.append({"spec": _spec_record(spec), "result": asdict(result)})


def _spec_record(spec: workload.Spec) -> dict[str, Any]:
    """The spec as JSON, long prompts shortened."""
    body = dict(spec.body)
    for key in ("prompt", "messages", "stop"):
        if key in body and len(repr(body[key])) > 200:
            body[key] = repr(body[key])[:200] + "..."
    rec = {k: v for k, v in asdict(spec).items() if k not in ("body", "raw_body")}
    rec["body"] = body
    if spec.raw_body is not None:
        rec["raw_body"] = spec.raw_body[:200].decode("utf-8", "replace")
    return rec


async def inject_faults(rng: random.Random, deadline: float, http: httpx.AsyncClient,
                        oai: openai.AsyncOpenAI, cfg: SoakConfig,
                        record: dict[str, Any]) -> None:
    """Arms a fault at random times (gaps drawn uniformly from 0.75-1.25 x `fault_interval`,
    whatever the victims' latency), the kinds in turn, each on the path of one victim request:
    a prompt that starts with fresh random token ids, sent right after arming. The victim must
    get a clear error."""
    kinds = itertools.cycle(FAULT_KINDS)
    victims = []
    due = time.time()
    while True:
        due += cfg.fault_interval * rng.uniform(0.75, 1.25)
        if due > deadline - 2.0:
            break
        await asyncio.sleep(max(0.0, due - time.time()))
        kind = next(kinds)
        marker = [rng.randrange(1000, 40000) for _ in range(8)]
        fault: dict[str, Any] = {"kind": kind, "prompt_prefix": marker, "armed_at": time.time()}
        record["faults"].append(fault)
        try:
            arm = await http.post("/debug/faults", json={"kind": kind, "prompt_prefix": marker})
            fault["arm_status"] = arm.status_code
        except httpx.TransportError as exc:
            fault["arm_status"], fault["arm_error"] = None, f"{type(exc).__name__}: {exc}"
        if fault["arm_status"] == 200:
            spec = workload.Spec("victim", "completion", "httpx",
                                 {"model": record["model"], "prompt": marker + [17, 42, 7],
                                  "max_tokens": 8, "stream": rng.random() < 0.5})
            victims.append(asyncio.create_task(_send_victim(spec, fault, http, oai, cfg,
                                                            record)))
    await asyncio.gather(*victims)


async def _send_victim(spec: workload.Spec, fault: dict[str, Any], http: httpx.AsyncClient,
                       oai: openai.AsyncOpenAI, cfg: SoakConfig, record: dict[str, Any]) -> None:
    result = await clients.send(spec, http, oai, cfg.request_timeout)
    fault["victim"] = len(record["results"])
    record["results"].append({"spec": _spec_record(spec), "result": asdict(result)})


async def _sample_rss(server: SoakServer, out: list[tuple[float, Optional[int]]],
                      stop: asyncio.Event) -> None:
    while not stop.is_set():
        out.append((time.time(), server.rss_bytes()))
        try:
            await asyncio.wait_for(stop.wait(), 1.0)
        except asyncio.TimeoutError:
            pass


async def check_integrity(http: httpx.AsyncClient) -> dict[str, Any]:
    """`GET /debug/check_integrity`: `{"time", "status", "ok", "error"}`; ok is None when the
    engine could not run the check (e.g. a 503 while its loop restarts)."""
    entry: dict[str, Any] = {"time": time.time(), "status": None, "ok": None, "error": ""}
    try:
        r = await http.get("/debug/check_integrity")
        entry["status"] = r.status_code
        body = clients.parse_json(r.content)
        if isinstance(body, dict) and "ok" in body:
            entry["ok"], entry["error"] = bool(body["ok"]), str(body.get("error", ""))
        else:
            entry["error"] = str(body)[:300]
    except httpx.HTTPError as exc:
        entry["error"] = f"{type(exc).__name__}: {exc}"
    return entry


async def _check_integrity_every(http: httpx.AsyncClient, cfg: SoakConfig,
                                 out: list[dict[str, Any]], stop: asyncio.Event) -> None:
    while True:
        try:
            await asyncio.wait_for(stop.wait(), cfg.integrity_interval)
            return
        except asyncio.TimeoutError:
            out.append(await check_integrity(http))


async def _final_checks(server: SoakServer, cfg: SoakConfig,
                        references: list[tuple[str, dict[str, Any]]], model: str,
                        http: httpx.AsyncClient, oai: openai.AsyncOpenAI,
                        record: dict[str, Any]) -> None:
    """Disarms leftover faults, waits for the engine to be idle, then: integrity, every block
    free, `/health`, one greedy request equal to the clean run's, RSS."""
    final: dict[str, Any] = {}
    record["final"] = final
    final["fault_state"] = await _get_json(http, "DELETE", "/debug/faults")
    final["idle_stats"], final["idle_after_s"] = await _wait_idle(http, cfg.request_timeout)
    final["integrity"] = await check_integrity(http)
    try:
        final["health"] = (await http.get("/health")).status_code
    except httpx.HTTPError as exc:
        final["health"] = f"{type(exc).__name__}: {exc}"
    api, body = references[0]
    spec = workload.Spec("final", api, "openai", {**body, "model": model}, reference=0)
    result = await clients.send(spec, http, oai, cfg.request_timeout)
    record["results"].append({"spec": _spec_record(spec), "result": asdict(result)})
    final["rss_end"] = server.rss_bytes()
    final["alive"] = server.alive()


async def _get_json(http: httpx.AsyncClient, method: str, path: str) -> Any:
    try:
        return clients.parse_json((await http.request(method, path)).content)
    except httpx.HTTPError as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}


def is_idle(stats: Any) -> bool:
    """No request running, waiting or swapped, and every block free."""
    return (isinstance(stats, dict) and not stats.get("num_running")
            and not stats.get("num_waiting") and not stats.get("num_swapped")
            and stats.get("num_free_blocks") == stats.get("num_total_blocks"))


async def _wait_idle(http: httpx.AsyncClient, timeout: float) -> tuple[Any, Optional[float]]:
    """`/internal/stats` once the engine is idle (or the last one seen after `timeout` s), and
    the seconds it took (None if never idle)."""
    t0 = time.time()
    stats: Any = None
    while time.time() - t0 < timeout:
        stats = await _get_json(http, "GET", "/internal/stats")
        if is_idle(stats):
            return summarize_stats(stats), round(time.time() - t0, 2)
        await asyncio.sleep(0.25)
    return summarize_stats(stats), None
