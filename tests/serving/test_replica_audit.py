"""The receivers' audit without an engine: how a replica's answers are judged (``serving.audit``), and
a worker's parameter audit (``serving.engine.params_audit``) over a real node mirror and a stand-in
model whose loader the scatter map traces. The same code against real vLLM servers, with faults
injected, is tests/integrations/test_vllm_audit.py.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from typing import Any

import httpx
import pytest
from scripted_vllm import ScriptedVLLM

torch = pytest.importorskip("torch")

import deltasync as ds  # noqa: E402
from deltasync.errors import (  # noqa: E402
    ChainBroken,
    DeltaSyncError,
    MalformedAnswer,
    ObjectTooLarge,
    ProtocolError,
    ServerError,
)
from deltasync.fetcher.metrics import SyncMetrics  # noqa: E402
from deltasync.protocol.audit import AuditPolicy  # noqa: E402
from deltasync.protocol.probes import PROBES_KEY, ProbeSet, Reference, reference_key  # noqa: E402
from deltasync.run.probes import write_probes, write_reference  # noqa: E402
from deltasync.serving.audit import (  # noqa: E402
    AuditConfig,
    AuditSource,
    ParamsAudit,
    ProbeOutput,
    ReplicaAuditor,
    audit_server,
    canary_tokens,
    http_probe,
    run_params_audit,
)
from deltasync.serving.driver import VLLMDriver, VLLMServer  # noqa: E402
from deltasync.serving.engine.mirror import EngineMirror, MirrorOptions  # noqa: E402
from deltasync.serving.engine.params_audit import ParamsAuditor  # noqa: E402
from deltasync.serving.engine.scatter import ScatterLoader  # noqa: E402
from deltasync.serving.http_call import BoundedHTTP  # noqa: E402
from deltasync.serving.worker_api import ParamsChunk  # noqa: E402

NAMES = ["a.w", "b.w", "c.w", "d.w"]
PROBES = ProbeSet(
    ((1, 2, 3, 4, 5, 6), (7, 8, 9, 10, 11, 12)), 16, AuditPolicy(max_mean_abs=0.01, max_max_abs=0.1, max_kl=None)
)


def _state(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(5)
    out = {n: torch.randn(32, 8, generator=g).to(torch.bfloat16) for n in NAMES}
    for s in range(1, step + 1):
        out[NAMES[s % len(NAMES)]][s, :4] += 0.25
    return out


def _rows(shift: float = 0.0) -> tuple[tuple[float, ...], ...]:
    return tuple(tuple(-2.0 - 0.1 * j - shift for j in range(len(p) - 1)) for p in PROBES.tokens)


@pytest.fixture(scope="module")
def run() -> ds.MemoryStore:
    """Steps 0..3 of a small state, the run's probes, and references of steps 1 and 2."""
    store = ds.MemoryStore("audit")
    with ds.DeltaUploader(store, anchor_every=100, anchor_bytes_fraction=0) as up:
        for s in range(4):
            up.push(_state(s), s).result()
    write_probes(store, PROBES)
    for s in (1, 2):
        write_reference(store, Reference(s, PROBES.digest, _rows(), "float32"))
    return store


def test_a_replica_is_judged_against_the_reference_the_canary_and_its_last_audit(run: ds.MemoryStore) -> None:
    auditor = ReplicaAuditor(AuditSource(run))
    fresh = {5: -1.0, 6: -2.0}
    ok = auditor.judge(1, ProbeOutput(_rows(0.001), fresh, dict(fresh)))
    assert not ok.diverged and ok.divergence is not None and math.isclose(ok.divergence.mean_abs, 0.001)
    assert ok.cache_delta == 0.0 and ok.report().audited_step == 1 and ok.summary().endswith(": ok")
    # over the policy's mean and max against step 2's reference
    far = auditor.judge(2, ProbeOutput(_rows(0.5), fresh, dict(fresh)))
    assert far.diverged and [p.split(":")[1].split()[0] for p in far.problems] == ["mean_abs", "max_abs"]
    # the canary read through the cache answers otherwise than fresh: KV of earlier weights
    stale = auditor.judge(2, ProbeOutput(_rows(), fresh, {5: -1.01, 6: -2.0}))
    assert stale.diverged and "prefix cache" in stale.problems[0] and stale.cache_delta == pytest.approx(0.01)
    # step 3 (no reference) computing exactly what step 2 did, though their weights differ: not updated
    same = auditor.judge(3, ProbeOutput(_rows(), None, None))
    assert same.divergence is None and same.diverged and "did not reach the weights" in same.problems[0]
    # the same logprobs at the same step is no finding
    assert not auditor.judge(3, ProbeOutput(_rows(), None, None)).diverged
    assert [a.step for a in auditor.history] == [1, 2, 2, 3, 3]


def test_shapes_and_canaries_are_checked() -> None:
    store = ds.MemoryStore("bare")
    with ds.DeltaUploader(store) as up:
        up.push({"model.embed_tokens.weight": torch.zeros(32, 4)}, 0).result()
    source = AuditSource(store, AuditConfig(probes=PROBES, canary_len=20))
    with pytest.raises(DeltaSyncError, match="probe 0 has 3 logprobs, expected 5"):
        ReplicaAuditor(source).judge(0, ProbeOutput(((-1.0,) * 3, (-1.0,) * 5)))
    canary = source.canary()
    assert canary is not None and len(canary) == 20 and canary[:6] == PROBES.tokens[0]
    assert canary_tokens(PROBES, 3) == (1, 2, 3)
    assert ProbeOutput((), {1: -1.0, 2: -2.0}, {3: -1.0, 4: -2.0}).cache_delta() == math.inf
    with pytest.raises(ValueError, match="action"):
        AuditConfig(action="repair")  # type: ignore[arg-type]
    # a run without probes.json gets the default ones of its inventory and run id
    assert AuditSource(store).probes().vocab_size == 32


def test_http_probe_reads_vllm_answers() -> None:
    canary = canary_tokens(PROBES, 8)
    asked: list[dict[str, Any]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        import json

        body = json.loads(request.content)
        asked.append(body)
        top = {"token_id:5": -1.0, "token_id:6": -2.5}
        if "prompt_logprobs" not in body:
            return httpx.Response(200, json={"choices": [{"index": 0, "logprobs": {"top_logprobs": [top]}}]})
        choices = []
        for i, prompt in reversed(list(enumerate(body["prompt"]))):  # any order: sorted by index
            pl = [None] + [
                {str(t): {"logprob": -0.5 * j, "rank": 1}, "999": {"logprob": -9.0}} for j, t in enumerate(prompt[1:])
            ]
            choices.append({"index": i, "prompt_logprobs": pl, "logprobs": {"top_logprobs": [top]}})
        return httpx.Response(200, json={"choices": choices})

    api = BoundedHTTP("http://vllm", transport=httpx.MockTransport(handler))
    out = http_probe(api, "m", PROBES, canary)
    api.close()
    assert out.logprobs == tuple(tuple(-0.5 * j for j in range(5)) for _ in PROBES.tokens)
    assert out.canary_fresh == out.canary_cached == {5: -1.0, 6: -2.5} and out.cache_delta() == 0.0
    assert [("prompt_logprobs" in b, b["max_tokens"]) for b in asked] == [(False, 1), (True, 1)]
    assert asked[1]["prompt"][0] == list(canary)


class Model(torch.nn.Module):
    """Parameters ``a_w`` .. ``d_w``; ``d.w``'s load casts (no plain copy: not mapped)."""

    def __init__(self, state: dict[str, Any]) -> None:
        super().__init__()
        self.p = torch.nn.ParameterDict(
            {n.replace(".", "_"): torch.nn.Parameter(t.clone(), requires_grad=False) for n, t in state.items()}
        )

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> set[str]:
        done = set()
        for name, t in weights:
            p = self.p[name.replace(".", "_")]
            p.copy_(t.float().to(p.dtype) if name == "d.w" else t)
            done.add(name)
        return done


def test_the_parameter_audit_names_what_was_written_behind_the_sync(run: ds.MemoryStore) -> None:
    model = Model(_state(0))
    metrics = SyncMetrics()
    mirror = EngineMirror(
        ds.DeltaFetcher(run),
        model.load_weights,
        MirrorOptions(
            seed=_state(0), seed_step=0, scatter=lambda layout: ScatterLoader(model, layout, model.load_weights)
        ),
        metrics=metrics,
    )
    try:
        mirror.commit(2)
        auditor = ParamsAuditor(model, model.load_weights)
        whole = auditor.chunk(mirror, 0, 1 << 30)
        assert (whole.step, whole.checked, whole.mismatched, whole.unchecked, whole.next) == (2, 3, (), ("d.w",), None)
        with torch.no_grad():
            model.p["b_w"][0, 0] += 1.0  # a second writer
        calls: list[int] = []

        def call(start: int, max_bytes: int) -> list[dict[str, Any]]:
            calls.append(start)
            return [auditor.chunk(mirror, start, max_bytes).to_json()]

        merged = run_params_audit(call, AuditConfig(params_chunk_bytes=1))  # one tensor per call
        assert calls == [0, 1, 2, 3] and merged.calls == 4
        assert (merged.step, merged.checked, merged.mismatched, merged.unchecked) == (2, 3, ("b.w",), ("d.w",))
        text = metrics.render()  # 3 + 3 tensors re-hashed, one mismatch
        assert 'deltasync_param_audit_tensors_total{result="mismatch"} 1' in text
        assert 'deltasync_param_audit_tensors_total{result="ok"} 5' in text
    finally:
        mirror.close()


class ComputingVLLM(ScriptedVLLM):
    """A scripted server that also answers the audit's requests: its probe logprobs are the references'
    plus about 0.001 (a little more at each version), or 0.5 off at the weight versions in ``wrong``
    (what it computes there is not the step)."""

    def __init__(self) -> None:
        super().__init__()
        self.wrong: set[str] = set()
        self.audits: list[dict[str, Any]] = []

    def handle(self, request: httpx.Request) -> httpx.Response:
        import json

        path = request.url.path
        body = json.loads(request.content) if request.content else {}
        if path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "tiny"}]})
        if path == "/v1/completions":
            shift = 0.5 if self.version in self.wrong else 0.001 + 1e-4 * int(self.version or 0)  # moves each step
            rows = dict(zip(PROBES.tokens, _rows(shift), strict=True))
            choices = [
                {
                    "index": i,
                    "prompt_logprobs": [None]
                    + [{str(t): {"logprob": v}} for t, v in zip(p[1:], rows[tuple(p)], strict=True)],
                }
                for i, p in enumerate(body["prompt"])
            ]
            return httpx.Response(200, json={"choices": choices})
        if path == "/collective_rpc" and body["method"] == "deltasync_audit_report":
            self.audits.append(body["kwargs"])
            return httpx.Response(200, json={"results": [None]})
        return super().handle(request)


def _audited(*fakes: ComputingVLLM, run: ds.MemoryStore, **config: Any) -> VLLMDriver:
    servers = [VLLMServer(f"http://vllm-{i}", transport=f.transport()) for i, f in enumerate(fakes)]
    source = AuditSource(run, AuditConfig(canary=False, **config))
    return VLLMDriver(servers, "s3://bucket/run", clock=lambda: 0.0, audit=source)


@pytest.mark.parametrize("action", ["report", "pause", "rollback"])
def test_the_driver_audits_each_update_and_acts_on_a_diverged_server(run: ds.MemoryStore, action: str) -> None:
    good, bad = ComputingVLLM(), ComputingVLLM()
    bad.wrong = {"2"}
    with _audited(good, bad, run=run, action=action) as d:
        d.init()
        assert [a is not None and not a.diverged and a.step == 0 for a in d.audit()] == [True, True]
        for u in d.update(1):
            assert u.ok and u.audit is not None and not u.audit.diverged and u.audit.divergence is not None
        ug, ub = d.update(2)
        assert ug.audit is not None and not ug.audit.diverged
        assert ub.ok and ub.audit is not None and ub.audit.diverged and "mean_abs" in ub.audit.problems[0]
        assert bad.audits == [] and good.audits == []  # reported by the driver alone, not again by the workers
        serving = {"report": 2, "pause": 2, "rollback": 1}[action]
        assert d.serving() == {"http://vllm-0": 2, "http://vllm-1": serving}
        assert bad.paused == (action == "pause")  # out of the rotation
        ug, ub = d.update(3)
        assert ug.ok and ub.ok == (action != "pause")
        if action == "pause":
            assert ub.state == "needs_replacement" and bad.version == "2"


def test_weights_differ_across_manifest_formats() -> None:
    """Two steps' digests tell whether their weights differ; a tensor over 16 MiB has another digest in
    format 1 than in format 2 (SPEC.md "Digests"), so across formats it tells nothing by itself."""
    store = ds.MemoryStore("audit-formats")
    g = torch.Generator().manual_seed(0)
    s0 = {"big": torch.randn(17 << 19, generator=g).to(torch.bfloat16), "small": torch.randn(8, generator=g)}
    s1 = {"big": s0["big"].clone(), "small": s0["small"].clone()}
    s1["big"][:3] += 1  # only the big tensor changes
    s2 = {"big": s1["big"].clone(), "small": s1["small"] + 1}  # only the small one
    with ds.DeltaUploader(store, anchor_every=100, anchor_bytes_fraction=0, format_version=1) as up:
        up.push(s0, 0).result(60)
    with ds.DeltaUploader(store, anchor_every=100, anchor_bytes_fraction=0, format_version=2) as up:
        assert up.resume({k: v.clone() for k, v in s0.items()}, 0, strict=True)
        up.push(s1, 1).result(60)
        up.push(s2, 2).result(60)
    source = AuditSource(store)
    assert source.weights_differ(0, 0) is False
    assert source.weights_differ(0, 1) is None  # only the big tensor's digests differ, and by format
    assert source.weights_differ(1, 2) is True and source.weights_differ(0, 2) is True


# ------------------------------------------------------------------------------- hostile answers, bad inputs (issue 46)


def _completions(body: dict[str, Any]) -> dict[str, Any]:
    """A well-formed answer to the audit's completion request ``body`` (as vLLM writes it)."""
    top = {"token_id:5": -1.0, "token_id:6": -2.5}
    if "prompt_logprobs" not in body:
        return {"choices": [{"index": 0, "logprobs": {"top_logprobs": [top]}}]}
    choices = []
    for i, prompt in enumerate(body["prompt"]):
        pl = [None] + [{str(t): {"logprob": -0.5 * j}, "999": {"logprob": -9.0}} for j, t in enumerate(prompt[1:])]
        choices.append({"index": i, "prompt_logprobs": pl, "logprobs": {"top_logprobs": [top]}})
    return {"choices": choices}


def _a_prompt_entry(a: dict[str, Any]) -> dict[str, Any]:
    entry: dict[str, Any] = a["choices"][-1]["prompt_logprobs"][1]  # a probe's (the first choice is the canary)
    return entry


#: ways to spoil the batch answer (each a function of the good answer)
SPOILED: dict[str, Any] = {
    "a JSON list": lambda a: [a],
    "no choices": lambda a: {"id": "cmpl-1"},
    "a choice too few": lambda a: {"choices": a["choices"][1:]},
    "a choice twice": lambda a: {"choices": [a["choices"][0]] * len(a["choices"])},
    "a choice without index": lambda a: {"choices": [{**c, "index": None} for c in a["choices"]]},
    "a choice that is a string": lambda a: {"choices": ["x"] * len(a["choices"])},
    "no prompt logprobs": lambda a: {"choices": [{**c, "prompt_logprobs": None} for c in a["choices"]]},
    "prompt logprobs too short": lambda a: {
        "choices": [{**c, "prompt_logprobs": c["prompt_logprobs"][:-1]} for c in a["choices"]]
    },
    "a NaN logprob": lambda a: _a_prompt_entry(a).update({"2": {"logprob": math.nan}}) or a,
    "an infinite logprob": lambda a: _a_prompt_entry(a).update({"2": {"logprob": -math.inf}}) or a,
    "a string logprob": lambda a: _a_prompt_entry(a).update({"2": {"logprob": "-1.0"}}) or a,
    "a positive logprob": lambda a: _a_prompt_entry(a).update({"2": {"logprob": 3.0}}) or a,
    "a key that is no token id": lambda a: _a_prompt_entry(a).update({"two": {"logprob": -1.0}}) or a,
    "a negative token id": lambda a: _a_prompt_entry(a).update({"-2": {"logprob": -1.0}}) or a,
    "a token id out of range": lambda a: _a_prompt_entry(a).update({"99999999999": {"logprob": -1.0}}) or a,
    "the prompt token missing": lambda a: a["choices"][-1]["prompt_logprobs"].__setitem__(1, {"999": -1.0}) or a,
    "no canary top logprobs": lambda a: a["choices"][0].update({"logprobs": {"top_logprobs": []}}) or a,
}


def _probe_server(spoil: Any = None, status: int = 200) -> tuple[BoundedHTTP, list[dict[str, Any]]]:
    asked: list[dict[str, Any]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        asked.append(body)
        answer = _completions(body)
        if spoil is not None and "prompt_logprobs" in body:
            answer = spoil(answer)
        if status != 200:
            return httpx.Response(status, json={"error": {"message": "token id 70000 is out of vocabulary"}})
        return httpx.Response(200, content=json.dumps(answer).encode())  # NaN and Infinity written as Python does

    return BoundedHTTP("http://vllm", transport=httpx.MockTransport(handler)), asked


@pytest.mark.parametrize("spoiled", list(SPOILED))
def test_a_spoiled_completion_answer_is_a_malformed_answer(spoiled: str) -> None:
    api, _ = _probe_server(SPOILED[spoiled])
    with pytest.raises(MalformedAnswer, match="not a vLLM completion answer"):
        http_probe(api, "m", PROBES, canary_tokens(PROBES, 8))


def test_a_probe_set_the_engine_refuses_says_what_to_fix() -> None:
    api, asked = _probe_server(status=400)
    with pytest.raises(ServerError, match=r"refused the audit's probes .*AuditConfig\(probes=") as caught:
        http_probe(api, "m", PROBES, None)
    assert type(caught.value) is ServerError and len(asked) == 1
    api, _ = _probe_server(status=500)
    with pytest.raises(ServerError, match="the audit's completion request failed: HTTP 500"):
        http_probe(api, "m", PROBES, None)


def test_the_completion_answer_is_capped_by_the_size_of_the_probe_set() -> None:
    huge = httpx.MockTransport(lambda r: httpx.Response(200, content=b" " * (64 << 20)))
    with pytest.raises(MalformedAnswer, match="over the 110,592 this call takes"):
        http_probe(BoundedHTTP("http://vllm", transport=huge), "m", PROBES, None)


@pytest.mark.parametrize(
    "body",
    [b"garbage", b"[" * 100_000, b'{"format_version": 1, "probes": "all"}', b" " * ((1 << 20) + 1)],
    ids=["garbage", "deep", "wrong shape", "over 1 MiB"],
)
def test_a_damaged_probes_json_means_the_audit_cannot_run_and_says_what_to_fix(body: bytes) -> None:
    store = ds.MemoryStore("bad-probes")
    store.put(PROBES_KEY, body)
    with pytest.raises(ProtocolError, match=r"the audit cannot run\. Write a valid probes.json in a new run") as caught:
        AuditSource(store).probes()
    assert isinstance(caught.value, ObjectTooLarge) == (len(body) > 1 << 20)


def _damaged(good: Reference, damage: str) -> bytes:
    doc = json.loads(good.to_json())
    if damage == "NaN":
        doc["logprobs"][0][1] = math.nan
    elif damage == "row lengths":
        doc["logprobs"][1] = doc["logprobs"][1][:-1]
    elif damage == "other probes":
        doc["probes_digest"] = "0" * len(doc["probes_digest"])
    elif damage == "garbage":
        return b"\x00\xffnot json"
    elif damage == "over 4 MiB":
        return b" " * ((4 << 20) + 1)
    return json.dumps(doc).encode()


@pytest.fixture
def fresh_run() -> ds.MemoryStore:
    """Steps 0..2 of the small state and the run's probes, no reference."""
    store = ds.MemoryStore("audit-fresh")
    with ds.DeltaUploader(store, anchor_every=100, anchor_bytes_fraction=0) as up:
        for s in range(3):
            up.push(_state(s), s).result()
    write_probes(store, PROBES)
    return store


@pytest.mark.parametrize("damage", ["NaN", "row lengths", "other probes", "garbage", "over 4 MiB"])
def test_a_damaged_reference_leaves_the_canary_unchanged_and_parameter_checks_running(
    fresh_run: ds.MemoryStore, damage: str
) -> None:
    fresh_run.put(reference_key(2), _damaged(Reference(2, PROBES.digest, _rows(), "float32"), damage))
    auditor = ReplicaAuditor(AuditSource(fresh_run))
    fresh = {5: -1.0, 6: -2.0}
    assert not auditor.judge(1, ProbeOutput(_rows(), fresh, dict(fresh))).diverged  # no reference of step 1
    # step 2: the same logprobs as step 1, a stale canary, a tensor that does not hash: all three found
    params = ParamsAudit(2, 3, 100, mismatched=("b.w",))
    r = auditor.judge(2, ProbeOutput(_rows(), fresh, {5: -1.5, 6: -2.0}), params)
    assert r.divergence is None and [u.check for u in r.unavailable] == ["divergence"]
    assert "reference of step 2 cannot be used" in r.unavailable[0].why
    assert ["prefix cache" in r.problems[0], "exactly those of step 1" in r.problems[1]] == [True, True]
    assert "do not hash to step 2's digests (b.w)" in r.problems[2] and len(r.problems) == 3
    assert "not run: divergence: the reference of step 2 cannot be used" in r.summary()
    assert auditor.recheck(r) is None  # a damaged reference is written once: nothing new to compare


def test_a_reference_that_arrives_after_the_audit_is_compared_by_recheck(fresh_run: ds.MemoryStore) -> None:
    now = [0.0]
    source = AuditSource(fresh_run, AuditConfig(canary=False, reference_every=5.0), clock=lambda: now[0])
    auditor = ReplicaAuditor(source)
    first = auditor.judge(2, ProbeOutput(_rows(0.5)))  # 0.5 nats off: no reference to say so yet
    assert first.divergence is None and not first.diverged and not first.unavailable
    write_reference(fresh_run, Reference(2, PROBES.digest, _rows(), "float32"))
    now[0] = 4.0
    assert auditor.recheck(first) is None  # an absent reference is looked up at most once per 5 s
    now[0] = 5.0
    late = auditor.recheck(first)
    assert late is not None and late.divergence is not None and math.isclose(late.divergence.mean_abs, 0.5)
    assert late.diverged and late.problems[0].startswith("against the trainer's reference: mean_abs")
    assert late.fingerprint == first.fingerprint and late.logprobs == first.logprobs  # the engine was not asked
    assert auditor.recheck(late) is None and auditor.history == [first, late]
    # a late reference that is damaged: the check is listed as not run, once
    fresh_run.put(reference_key(1), _damaged(Reference(1, PROBES.digest, _rows(), "float32"), "garbage"))
    one = auditor.judge(1, ProbeOutput(_rows()))
    assert [u.check for u in one.unavailable] == ["divergence"]  # found at once: step 1 was never looked up


# ------------------------------------------------------------------------------- the parameter audit, bounded


def _chunk(start: int, nxt: int | None, rank: int = 0, **kw: Any) -> dict[str, object]:
    return ParamsChunk(rank, 2, 1, 10, next=nxt, **kw).to_json()


def test_a_parameter_audit_that_does_not_advance_is_stopped_after_one_answer() -> None:
    calls: list[int] = []

    def call(start: int, max_bytes: int) -> dict[str, object]:
        calls.append(start)
        return {"results": [_chunk(start, 0)]}  # next: 0, forever

    with pytest.raises(MalformedAnswer, match="next chunk 0 after the chunk at 0: it does not advance"):
        run_params_audit(call, AuditConfig())
    assert calls == [0]


def test_a_parameter_audit_that_never_ends_is_stopped_at_its_call_budget() -> None:
    calls: list[int] = []

    def call(start: int, max_bytes: int) -> list[dict[str, object]]:
        calls.append(start)
        return [_chunk(start, start + 1)]

    with pytest.raises(MalformedAnswer, match="did not end within 5 calls"):
        run_params_audit(call, AuditConfig(params_max_calls=5))
    assert calls == [0, 1, 2, 3, 4]


@pytest.mark.parametrize(
    ("answer", "error"),
    [
        ([_chunk(0, None, 0), _chunk(0, 3, 1)], "disagree"),
        (["done"], "expected a JSON object"),
        ({"results": []}, "one answer per worker"),
        ([{"rank": 0, "step": 2, "checked": -1}], "checked"),
        ([{"rank": 0, "step": 2, "mismatched": "a.w"}], "mismatched"),
    ],
)
def test_a_parameter_audit_answer_of_the_wrong_shape_is_malformed(answer: object, error: str) -> None:
    with pytest.raises(MalformedAnswer, match=error):
        run_params_audit(lambda **kw: answer, AuditConfig())


def test_a_worker_s_parameter_audit_error_is_raised_as_its_own_class() -> None:
    answer = [ParamsChunk(1, None, 0, 0, error="step 2 is not mirrored", error_code=ChainBroken.code).to_json()]
    with pytest.raises(ChainBroken, match="rank 1: step 2 is not mirrored"):
        run_params_audit(lambda **kw: answer, AuditConfig())


def test_a_server_s_parameter_audit_that_does_not_advance_ends_the_audit_with_a_typed_error(
    run: ds.MemoryStore,
) -> None:
    fake = ComputingVLLM()
    fake.hostile["/collective_rpc deltasync_audit_params"] = lambda r: httpx.Response(
        200, json={"results": [_chunk(0, 0)]}
    )
    server = VLLMServer("http://vllm-a", transport=fake.transport())
    auditor = ReplicaAuditor(AuditSource(run, AuditConfig(canary=False)))
    with pytest.raises(MalformedAnswer, match="does not advance"):
        audit_server(server, auditor, 0, params=True)
    assert fake.calls.count("/collective_rpc") == 1 and fake.audits == []
    assert not audit_server(server, auditor, 0).diverged  # without the parameter audit: fine, nothing sent
    assert fake.audits == []
