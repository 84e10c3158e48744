"""The benchmark records and their index (benchmarks/README.md).

Records are JSON files in one folder (``benchmarks/records/`` in the repository) beside one index,
``index.json`` there, whose ``records`` list names each record once: its ``file``, the ``command``
that wrote it, the ``machine`` and ``date`` read from the record, the ``claims`` it backs (each
``{"in": a file of the repository, "cited_as": how it names the record, "claim": the sentence or
figure there}``) and ``what`` it holds.

``python -m jax_sparse_attn.bench --record NAME [--claim TEXT]`` writes ``NAME.json`` into the
records folder and adds or updates its entry; so does ``--json PATH`` where PATH's folder holds an
index. ``python -m jax_sparse_attn.bench.records [DIR]`` prints the index as a table;
``--find-claims`` first rereads the claims from README.md, docs/*.md and the library's docstrings
(:func:`find_claims`).

A helper of the bottom layer: it imports no other benchmark module (it reads records as JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import shlex
import sys
from typing import Optional, Sequence

RECORDS_DIR = pathlib.Path("benchmarks") / "records"
INDEX_NAME = "index.json"
# Environment variables that change what a benchmark measures, kept in its command line.
COMMAND_ENV_VARS = ("XLA_FLAGS", "JAX_SPARSE_ATTN_CPU_PRODUCTS", "JAX_PLATFORMS")


def index_path(record_path) -> pathlib.Path:
    """The index of the folder that holds ``record_path``."""
    return pathlib.Path(record_path).parent / INDEX_NAME


def read_index(path) -> dict:
    """The index at ``path``: ``{"records": [entry, ...]}``."""
    index = json.loads(pathlib.Path(path).read_text())
    if not isinstance(index.get("records"), list):
        raise ValueError(f"{path}: an index holds a list under 'records'")
    return index


def machine(record: dict) -> str:
    """The machine a record names: the measuring host's CPU (and accelerator), or for a cost-model
    record the modelled target and the host that ran the model."""
    env = record.get("environment")
    if env:
        cpu = env.get("cpu", {})
        text = cpu.get("model name") or "unknown CPU"
        if "cpu family" in cpu:
            text += f" (family {cpu['cpu family']}, model {cpu.get('model', '?')})"
        if cpu.get("flags"):
            text += f" [{cpu['flags']}]"
        text += f", {env.get('cpu_count', '?')} vCPUs"
        if env.get("backend") not in (None, "cpu"):
            text = f"{env.get('device', env['backend'])}; host {text}"
        text += f"; jax {env.get('jax', '?')}"
        return text
    if "target" in record:
        host = record.get("host_cpu") or record.get("host") or "an unrecorded host"
        return f"MODEL of {record['target']} (not a measurement), run on {host}"
    return "not recorded"


def date(record: dict) -> Optional[str]:
    """The record's own date (UTC), where it holds one."""
    return (record.get("environment") or {}).get("date_utc") or record.get("date")


def command_line(program: str, argv: Sequence[str], environ=os.environ) -> str:
    """``program argv...`` as a shell would take it, prefixed with the environment variables
    that change what a benchmark measures."""
    env = [f"{k}={shlex.quote(environ[k])}" for k in COMMAND_ENV_VARS if environ.get(k)]
    return " ".join(env + [program, shlex.join(list(argv))]).strip()


def add_index_entry(record_path, command: str, claim: Optional[str] = None,
                    claim_in: str = "README.md", what: Optional[str] = None) -> dict:
    """Adds or updates the entry of the record at ``record_path`` in its folder's index (created
    if missing): command, machine and date from the record; ``claim`` joins the entry's claims
    (those already listed are kept, and so are the entry's other fields). Returns the entry."""
    record_path = pathlib.Path(record_path)
    record = json.loads(record_path.read_text())
    path = index_path(record_path)
    index = read_index(path) if path.exists() else {"records": []}
    entries = index["records"]
    old = next((e for e in entries if e.get("file") == record_path.name), None)
    entry = {"file": record_path.name, "command": command, "machine": machine(record),
             "date": date(record), "claims": list(old.get("claims", [])) if old else [],
             "what": what if what is not None else (old or {}).get("what", "")}
    entry.update({k: v for k, v in (old or {}).items() if k not in entry})  # e.g. drawn_by
    if claim and not any(c.get("claim") == claim for c in entry["claims"]):
        entry["claims"].append({"in": claim_in, "claim": claim})
    if old is None:
        entries.append(entry)
    else:
        entries[entries.index(old)] = entry
    entries.sort(key=lambda e: e["file"])
    path.write_text(json.dumps(index, indent=1, ensure_ascii=False) + "\n")
    print(f"# indexed {record_path.name} in {path}", flush=True)
    return entry


def index_if_indexed(record_path, program: str, argv: Optional[Sequence[str]] = None) -> bool:
    """Adds the entry of the record just written at ``record_path`` to its folder's index, where
    the folder holds one (the scripts of benchmarks/ call this after ``--json PATH``); ``argv``
    defaults to this process's arguments. Returns whether it did."""
    if not index_path(record_path).exists():
        return False
    add_index_entry(record_path, command_line(program, sys.argv[1:] if argv is None else argv))
    return True


# --- the claims: where README.md, docs/ and docstrings cite a record -------------------------------

# A record's name as the docs write it: a path or a bare name, with shell braces ({a,b}) and
# wildcards (*) allowed, or a short form after a full name (`model-trn2-indexer.json` and
# `-before.json`).
_CITATION = re.compile(r"(?:[\w.{},*-]+/)*[\w.{},*-]+\.(?:json|png)")


def _expand_braces(word: str) -> list:
    m = re.search(r"\{([^{}]*)\}", word)
    if not m:
        return [word]
    return [w for alt in m.group(1).split(",")
            for w in _expand_braces(word[:m.start()] + alt + word[m.end():])]


def cites(citation: str, name: str) -> bool:
    """Whether ``citation`` (a file name with braces and wildcards) names the record ``name``."""
    return any(re.fullmatch(re.escape(w).replace(r"\*", ".*"), name)
               for w in _expand_braces(citation.split("/")[-1]))


def _resolve_short(short: str, previous: Optional[str], names: Sequence[str]) -> Optional[str]:
    """``-before.json`` after ``model-trn2-indexer.json``: the longest cut of the previous name,
    at a dash, that with the short form names a record."""
    if not previous:
        return None
    parts = previous.rsplit(".", 1)[0].split("-")
    for k in range(len(parts), 0, -1):
        full = "-".join(parts[:k]) + short
        if any(cites(full, n) for n in names):
            return full
    return None


def _sentence(paragraph: str, start: int, end: int) -> str:
    """The sentence of ``paragraph`` around ``[start, end)``, with the one before it where the
    citation stands nearly alone (``Files: ...``)."""
    s0 = paragraph.rfind(". ", 0, start)
    s0 = 0 if s0 < 0 else s0 + 2
    e0 = paragraph.find(". ", end)
    e0 = len(paragraph) if e0 < 0 else e0 + 1
    if e0 - s0 < 160 and s0 > 0:
        s1 = paragraph.rfind(". ", 0, s0 - 2)
        s0 = 0 if s1 < 0 else s1 + 2
    text = paragraph[s0:e0].strip().lstrip("- ").strip()
    return text if len(text) <= 700 else text[:697].rstrip() + "..."


def find_claims(root, names: Sequence[str], sources: Optional[Sequence[str]] = None,
                broad: int = 6) -> dict:
    """``{name: [claim, ...]}``: for each record name, the sentences of ``sources`` that cite it,
    each ``{"in", "cited_as", "claim"}`` (and ``cited_after``, the full name a short form
    follows). ``sources`` by default: README.md, docs/**/*.md and the library's modules under
    ``root`` (their docstrings and comments; the benchmarks and their charts, which write and
    read records rather than cite them, excepted). A citation that names more than ``broad`` records
    (``benchmarks/model-trn2*.json``) counts for a record only where nothing else cites it."""
    root = pathlib.Path(root)
    if sources is None:
        docs = sorted(str(p.relative_to(root)) for p in (root / "docs").rglob("*.md")
                      if "_build" not in p.parts)
        package = root / "jax_sparse_attn"
        code = sorted(str(p.relative_to(root)) for p in package.rglob("*.py")
                      if p.parent != package / "bench" and p != package / "plots.py")
        sources = ["README.md"] + docs + code
    found: dict = {n: [] for n in names}  # (claim, how many records its citation names)
    for source in sources:
        text = (root / source).read_text()
        for paragraph in re.split(r"\n\s*\n", text):
            flat = " ".join(line.strip() for line in paragraph.splitlines())
            previous = None
            for m in _CITATION.finditer(flat):
                cited = m.group(0).split("/")[-1]
                full = cited
                if cited.startswith("-"):
                    full = _resolve_short(cited, previous, names)
                    if full is None:
                        continue
                else:
                    previous = cited
                if cited not in text:  # wrapped over two lines: not quotable as written
                    continue
                claim = {"in": source, "cited_as": cited,
                         "claim": _sentence(flat, m.start(), m.end())}
                if full != cited:
                    claim["cited_after"] = previous
                hits = [n for n in names if cites(full, n)]
                for n in hits:
                    if all(claim != c for c, _ in found[n]):
                        found[n].append((claim, len(hits)))
    return {n: [c for c, reach in pairs if reach <= broad] or [c for c, _ in pairs]
            for n, pairs in found.items()}


def refresh_claims(index: dict, root) -> list:
    """Rereads every entry's claims from the docs (:func:`find_claims`), keeping the claims that
    cite a record otherwise (by its command) while their text is still there. Returns the files
    left without a claim."""
    root = pathlib.Path(root)
    names = [e["file"] for e in index["records"]]
    charts_data = [n[:-4] + ".json" for n in names if n.endswith(".png")]
    found = find_claims(root, names + [n for n in charts_data if n not in names])
    bare = []
    for e in index["records"]:
        kept = [c for c in e.get("claims", []) if "cited_as" in c and not _CITATION.fullmatch(
            c["cited_as"].split("/")[-1]) and (root / c["in"]).exists()
            and c["cited_as"] in (root / c["in"]).read_text()]
        chart_of = e["file"][:-4] + ".json" if e["file"].endswith(".png") else None
        claims = found[e["file"]] or (found.get(chart_of, []) if chart_of else [])
        e["claims"] = claims + [c for c in kept if c not in claims]
        if not e["claims"]:
            bare.append(e["file"])
    return bare


def format_index(index: dict) -> str:
    """The index as a Markdown table: file, date, machine, claims, command."""
    lines = ["| file | date | machine | claims | command |", "|---|---|---|---|---|"]
    for e in index["records"]:
        claims = "; ".join(f"{c['in']}: {c['claim']}" for c in e.get("claims", [])) or "(none)"
        cells = [f"`{e['file']}`", e.get("date") or "-", e.get("machine", "-"), claims,
                 f"`{e.get('command', '-')}`"]
        cells = [c.replace("|", "\\|").replace("\n", " ") for c in cells]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m jax_sparse_attn.bench.records",
                                description="Prints a records folder's index as a Markdown table.")
    p.add_argument("folder", nargs="?", default=str(RECORDS_DIR),
                   help=f"the records folder (default {RECORDS_DIR})")
    p.add_argument("--find-claims", metavar="ROOT", nargs="?", const=".",
                   help="first reread every record's claims from ROOT's README.md, docs/**/*.md and "
                   "the library's docstrings "
                   "(default: the current folder) and rewrite the index")
    a = p.parse_args(argv)
    path = pathlib.Path(a.folder) / INDEX_NAME
    if not path.exists():
        p.error(f"folder: no {INDEX_NAME} in {a.folder}")
    index = read_index(path)
    if a.find_claims:
        bare = refresh_claims(index, a.find_claims)
        path.write_text(json.dumps(index, indent=1, ensure_ascii=False) + "\n")
        for name in bare:
            print(f"# {name}: no claim cites it (cite it, or remove it: git keeps it)",
                  file=sys.stderr)
    print(format_index(index))
    return 0


if __name__ == "__main__":
    sys.exit(main())
