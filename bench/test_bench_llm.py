"""``bench/llm.py`` at its tiny CPU size, every row: the table's invariants.

    python -m pytest bench/test_bench_llm.py -m slow      # about 3 minutes per configuration on 2 cores

What must hold in every run: the unmanaged and checkpointed rows and the watch row train; each micro-batch
has a padded length of its own (a multiple of 8); checkpointing and watching are bit-identical to the
unmanaged row and checkpointing holds less; an offloading row either ran, bit-identical, or says why it
could not (TRL's offloading needs an accelerator); each hybridmem row takes its budget from the row it names
and either trains bit-identical to the unmanaged row within that budget in real bytes or reports the error
that stopped it, in one line.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[test]')")
pytest.importorskip("peft", reason="peft is not installed (pip install peft)")

from bench import llm  # noqa: E402

CONFIGS = {"gpt2": ("--model", "gpt2"), "llama-lora-bf16": ("--model", "llama", "--lora", "--bf16")}


@pytest.mark.slow
@pytest.mark.parametrize("config", list(CONFIGS))
def test_every_row_keeps_the_tables_invariants(config: str, tmp_path: Path) -> None:
    assert llm.main(["--size", "tiny", "--steps", "3", "--out", str(tmp_path), *CONFIGS[config]]) == 0
    rows = {r["row"]: r for r in json.loads((tmp_path / "llm.json").read_text())["results"]}
    md = (tmp_path / "llm.md").read_text()
    assert list(rows) == list(llm.ROWS) and all(f"| {r} |" in md for r in llm.ROWS)
    base = rows["unmanaged"]
    assert base["status"] == "ok", base["error"]
    lo, hi = llm.SIZES["tiny"]["lengths"]
    assert len(set(base["lengths"])) == len(base["lengths"]) == 3 * 2
    assert all(n % 8 == 0 and lo <= n <= hi for n in base["lengths"])
    assert all(len(r["times"]) == 3 - llm.WARMUP for r in rows.values() if r["status"] == "ok")
    for name in ("hf_ckpt", "watch"):
        assert rows[name]["status"] == "ok", rows[name]["error"]
        assert rows[name]["same"] == "yes", name
    assert 0 < rows["hf_ckpt"]["peak"] < base["peak"]
    for name in ("offload", "offload+ckpt"):
        r = rows[name]
        assert (r["status"], r["same"]) == ("ok", "yes") or (r["status"] == "unavailable" and r["error"]), r
    assert rows["hybridmem@ckpt"]["budget"] == rows["hf_ckpt"]["peak"]
    assert rows["hybridmem@70"]["budget"] == int(llm.SHARE * rows["watch"]["hm_peak"])
    for name in ("hybridmem@ckpt", "hybridmem@70"):
        r = rows[name]
        if r["status"] == "ok":
            assert r["same"] == "yes", (name, r["same"])
            assert r["within"] == "yes" and 0 < r["peak"] <= r["budget"], (name, r["peak"], r["budget"])
            assert r["steady"] is not None and 0 <= r["steady"] <= r["hm_steps"]
        else:  # the runtime's failure, reported on the row in one line
            assert r["status"] == "error" and r["error"] and "\n" not in r["error"], r
            assert f"| {name} | {r['budget'] / 2**20:.1f} |" in md and r["error"][:40] in md
