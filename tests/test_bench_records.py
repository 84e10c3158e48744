"""The benchmark records and their index: ``--record`` writes a record and its index entry, and the
repository's index names every record of benchmarks/records/ with its command, machine, date and
the claims of README.md, docs/ and the library's docstrings that cite it."""

import itertools
import json
import os
import pathlib
import re

import pytest

from jax_sparse_attn.bench import cli, records

REPO = pathlib.Path(__file__).resolve().parent.parent
RECORDS = REPO / "benchmarks" / "records"
TINY = ["--shape", "2,4,64,32,128", "--repeats", "1", "--warmup", "0", "--no-naive", "--no-gemm"]


def _cpu_model_name():
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        return None


@pytest.mark.slow  # three runs of the command line, each compiling the op
def test_record_flag_writes_the_record_and_its_index_entry(tmp_path, capsys):
    folder = tmp_path / "records"
    args = TINY + ["--record", "tiny", "--records-dir", str(folder)]
    assert cli.main(args + ["--claim", "the tiny shape runs"]) == 0
    record = json.loads((folder / "tiny.json").read_text())
    assert len(record["records"]) == 1
    index = json.loads((folder / "index.json").read_text())
    (entry,) = index["records"]
    assert entry["file"] == "tiny.json"
    # The command line that wrote it (less the claim), after the variables that change a run.
    assert entry["command"].endswith("python -m jax_sparse_attn.bench " + " ".join(args))
    assert ("XLA_FLAGS=" in entry["command"]) == bool(os.environ.get("XLA_FLAGS"))
    assert "--claim" not in entry["command"]
    assert entry["date"] == record["environment"]["date_utc"]
    if _cpu_model_name():
        assert entry["machine"].startswith(_cpu_model_name())
    assert entry["claims"] == [{"in": "README.md", "claim": "the tiny shape runs"}]
    assert "# indexed tiny.json" in capsys.readouterr().out

    # Written again: the same entry, updated, its claims kept; a second record sorts beside it.
    assert cli.main(args + ["--claim", "a figure", "--claim-in", "docs/contract.md"]) == 0
    assert cli.main(TINY + ["--record", "a-first", "--records-dir", str(folder)]) == 0
    index = json.loads((folder / "index.json").read_text())
    assert [e["file"] for e in index["records"]] == ["a-first.json", "tiny.json"]
    assert index["records"][1]["claims"] == [
        {"in": "README.md", "claim": "the tiny shape runs"},
        {"in": "docs/contract.md", "claim": "a figure"}]
    assert index["records"][0]["claims"] == []


@pytest.mark.slow  # three runs of the command line
def test_json_into_an_indexed_folder_updates_its_index(tmp_path):
    (tmp_path / "indexed").mkdir()
    (tmp_path / "indexed" / "index.json").write_text('{"records": []}')
    assert cli.main(TINY + ["--json", str(tmp_path / "indexed" / "run.json")]) == 0
    index = json.loads((tmp_path / "indexed" / "index.json").read_text())
    assert [e["file"] for e in index["records"]] == ["run.json"]
    # A folder without an index gets none.
    (tmp_path / "plain").mkdir()
    assert cli.main(TINY + ["--json", str(tmp_path / "plain" / "run.json")]) == 0
    assert sorted(p.name for p in (tmp_path / "plain").iterdir()) == ["run.json"]
    # A claim asks for an entry: the folder gets an index.
    assert cli.main(TINY + ["--json", str(tmp_path / "plain" / "run.json"), "--claim", "c"]) == 0
    (entry,) = json.loads((tmp_path / "plain" / "index.json").read_text())["records"]
    assert entry["file"] == "run.json" and entry["claims"] == [{"in": "README.md", "claim": "c"}]


def test_index_entry_reads_machine_and_date_from_the_record(tmp_path):
    env = {"date_utc": "2026-12-06T01:02:03+00:00", "jax": "0.10.2", "backend": "cpu", "device": "cpu",
           "cpu": {"model name": "Some CPU", "cpu family": "25", "model": "1", "flags": "avx2"},
           "cpu_count": 2}
    (tmp_path / "b.json").write_text(json.dumps({"environment": env, "records": []}))
    (tmp_path / "a.json").write_text(json.dumps({"kind": "MODEL", "target": "trn2", "host_cpu": "Host",
                                                 "date": "2026-12-05T00:00:00+00:00"}))
    entry = records.add_index_entry(tmp_path / "b.json", "cmd b", "claim one")
    assert entry["machine"].startswith("Some CPU") and "2 vCPUs" in entry["machine"]
    assert entry["date"] == env["date_utc"] and entry["command"] == "cmd b"
    records.add_index_entry(tmp_path / "a.json", "cmd a")
    index = json.loads((tmp_path / "index.json").read_text())
    index["records"][1]["drawn_by"] = "notebooks/x.ipynb"
    (tmp_path / "index.json").write_text(json.dumps(index))
    records.add_index_entry(tmp_path / "b.json", "cmd b2", "claim two", claim_in="docs/x.md")
    records.add_index_entry(tmp_path / "b.json", "cmd b2", "claim two", claim_in="docs/x.md")
    index = json.loads((tmp_path / "index.json").read_text())["records"]
    assert [e["file"] for e in index] == ["a.json", "b.json"]
    assert index[0]["machine"] == "MODEL of trn2 (not a measurement), run on Host"
    assert index[0]["date"] == "2026-12-05T00:00:00+00:00" and index[0]["claims"] == []
    assert index[1]["command"] == "cmd b2" and index[1]["drawn_by"] == "notebooks/x.ipynb"
    assert index[1]["claims"] == [{"in": "README.md", "claim": "claim one"},
                                  {"in": "docs/x.md", "claim": "claim two"}]


@pytest.mark.parametrize("args, named", [
    (["--record", "x", "--json", "x.json"], "--record"),
    (["--record", "sub/x"], "--record"),
    (["--claim", "text"], "--claim"),
])
def test_record_flags_refuse_what_they_cannot_write(args, named, capsys):
    with pytest.raises(SystemExit):
        cli.main(TINY + args)
    assert named in capsys.readouterr().err


def test_command_line_keeps_the_variables_that_change_a_run():
    environ = {"XLA_FLAGS": "--xla_cpu_max_isa=AVX2 --a=", "HOME": "/root"}
    assert records.command_line("python -m jax_sparse_attn.bench", ["--cases", "mla"], environ) == (
        "XLA_FLAGS='--xla_cpu_max_isa=AVX2 --a=' python -m jax_sparse_attn.bench --cases mla")


# --- the repository's records ---------------------------------------------------------------------


def _expand(pattern):
    """Shell brace expansion of one word."""
    m = re.search(r"\{([^{}]*)\}", pattern)
    if not m:
        return [pattern]
    return list(itertools.chain.from_iterable(
        _expand(pattern[:m.start()] + alt + pattern[m.end():]) for alt in m.group(1).split(",")))


def _names(pattern, name):
    return any(re.fullmatch(re.escape(p).replace(r"\*", ".*"), name) for p in _expand(pattern))


def _index():
    return json.loads((RECORDS / "index.json").read_text())["records"]


def test_index_names_every_record_once():
    files = sorted(p.name for p in RECORDS.iterdir() if p.name != "index.json")
    assert files, "no records"
    assert sorted(e["file"] for e in _index()) == files


def test_index_entries_hold_command_machine_and_date_of_their_record():
    for e in _index():
        data_file = e["file"][:-4] + ".json" if e["file"].endswith(".png") else e["file"]
        record = json.loads((RECORDS / data_file).read_text())
        assert e["command"].strip(), e["file"]
        env = record.get("environment")
        if env:
            assert e["date"] == env["date_utc"], e["file"]
            assert e["machine"].startswith(env["cpu"]["model name"]) or env["backend"] != "cpu"
            if env["backend"] != "cpu":
                assert e["machine"].startswith(env["device"]), e["file"]
        else:  # the cost model's records: a MODEL of a target, never a measurement
            assert "MODEL" in record["kind"] and e["machine"].startswith(f"MODEL of {record['target']}")
            assert e["date"] == record.get("date") or "commit date" in e["date"], e["file"]


def test_every_record_backs_a_claim_that_cites_it():
    for e in _index():
        assert e["claims"], f"{e['file']} backs no claim: remove it (git keeps it)"
        for claim in e["claims"]:
            assert "cited_as" in claim, f"{e['file']}: say how {claim['in']} cites it (cited_as)"
            text = (REPO / claim["in"]).read_text()
            cited = claim["cited_as"]
            assert cited in text, (e["file"], claim["in"], cited)
            assert claim["claim"].strip()
            if "cited_after" in claim:  # `-before.json` after `model-trn2-indexer.json`
                assert claim["cited_after"] in text
                stem = claim["cited_after"].rsplit(".", 1)[0].split("-")
                cited = next(("-".join(stem[:k]) + cited for k in range(len(stem), 0, -1)
                              if _names("-".join(stem[:k]) + cited, e["file"])), cited)
            data_file = e["file"][:-4] + ".json"  # a chart is cited through its data
            assert (_names(cited, e["file"]) or (e["file"].endswith(".png") and _names(cited, data_file))
                    or cited in e["command"]), (e["file"], cited)


def test_find_claims_reads_each_form_of_citation(tmp_path):
    names = ["cpu-a-fwd.json", "cpu-a-grad.json", "model-x.json", "model-x-before.json",
             "model-x-tiled.json", "model-y.json", "model-z.json", "lonely.json"]
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text(
        "Intro. The forward takes 1.2 ms and the backward 3.4 ms on this machine, measured in the "
        "same rounds as the GEMM (`benchmarks/cpu-a-{fwd,grad}.json`). Then: `cpu-a-fwd.json`.\n\n"
        "Modelled: 5 us (`benchmarks/model-x.json` and `-before.json`).\n\n"
        "All models: `benchmarks/model-*.json`.\n")
    (tmp_path / "docs" / "k.md").write_text("The tiled kernel, 7 us: `model-x-t*.json`.\n")
    found = records.find_claims(tmp_path, names, broad=4)
    sentence = ("Intro. The forward takes 1.2 ms and the backward 3.4 ms on this machine, measured in "
                "the same rounds as the GEMM (`benchmarks/cpu-a-{fwd,grad}.json`).")
    claim = {"in": "README.md", "cited_as": "cpu-a-{fwd,grad}.json", "claim": sentence}
    assert found["cpu-a-grad.json"] == [claim]
    # A citation standing nearly alone brings the sentence before it.
    assert found["cpu-a-fwd.json"] == [claim, {"in": "README.md", "cited_as": "cpu-a-fwd.json",
                                               "claim": sentence[len("Intro. "):] + " Then: `cpu-a-fwd.json`."}]
    short = "Modelled: 5 us (`benchmarks/model-x.json` and `-before.json`)."
    assert found["model-x.json"] == [{"in": "README.md", "cited_as": "model-x.json", "claim": short}]
    assert found["model-x-before.json"] == [{"in": "README.md", "cited_as": "-before.json",
                                             "cited_after": "model-x.json", "claim": short}]
    assert found["model-x-tiled.json"] == [
        {"in": "docs/k.md", "cited_as": "model-x-t*.json", "claim": "The tiled kernel, 7 us: `model-x-t*.json`."}]
    # The catch-all names five records, more than broad: it counts only where nothing else cites.
    broad = {"in": "README.md", "cited_as": "model-*.json", "claim": "All models: `benchmarks/model-*.json`."}
    assert found["model-y.json"] == [broad] and found["model-z.json"] == [broad]
    assert found["lonely.json"] == []


def test_refresh_claims_keeps_command_citations_and_reports_the_uncited(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text("Memory 0.69 GiB (`python -m jax_sparse_attn.bench --memory --grad`).\n\n"
                                        "Sweep: `benchmarks/sweep.json`.\n")
    index = {"records": [
        {"file": "grad.json", "claims": [
            {"in": "README.md", "cited_as": "python -m jax_sparse_attn.bench --memory --grad", "claim": "c"},
            {"in": "README.md", "cited_as": "old.json", "claim": "a claim the README dropped"}]},
        {"file": "sweep.png", "claims": []},
        {"file": "gone.json", "claims": [{"in": "README.md", "cited_as": "gone.json", "claim": "x"}]}]}
    assert records.refresh_claims(index, tmp_path) == ["gone.json"]
    grad, chart, gone = index["records"]
    assert [c["cited_as"] for c in grad["claims"]] == ["python -m jax_sparse_attn.bench --memory --grad"]
    assert [c["cited_as"] for c in chart["claims"]] == ["sweep.json"]  # a chart, through its data
    assert gone["claims"] == []
