"""The benchmark records and their index (benchmarks/README.md).

Records are JSON files in one folder (``benchmarks/records/`` in the repository) beside one index,
``index.json`` there, whose ``records`` list names each record once: its ``file``, the ``command``
that wrote it, the ``machine`` and ``date`` read from the record, the ``claims`` it backs (each
``{"in": a file of the repository, "claim": the sentence or figure there}``) and ``what`` it holds.

``python -m jax_sparse_attn.bench --record NAME [--claim TEXT]`` writes ``NAME.json`` into the
records folder and adds or updates its entry; so does ``--json PATH`` where PATH's folder holds an
index. ``python -m jax_sparse_attn.bench.records [DIR]`` prints the index as a table.

A helper of the bottom layer: it imports no other benchmark module (it reads records as JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
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
    (those already listed are kept). Returns the entry."""
    record_path = pathlib.Path(record_path)
    record = json.loads(record_path.read_text())
    path = index_path(record_path)
    index = read_index(path) if path.exists() else {"records": []}
    entries = index["records"]
    old = next((e for e in entries if e.get("file") == record_path.name), None)
    entry = {"file": record_path.name, "command": command, "machine": machine(record),
             "date": date(record), "claims": list(old.get("claims", [])) if old else [],
             "what": what if what is not None else (old or {}).get("what", "")}
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


def format_index(index: dict) -> str:
    """The index as a Markdown table: file, date, machine, claims, command."""
    lines = ["| file | date | machine | claims | command |", "|---|---|---|---|---|"]
    for e in index["records"]:
        claims = "; ".join(f"{c['in']}: {c['claim']}" for c in e.get("claims", [])) or "(none)"
        cells = [f"`{e['file']}`", e.get("date") or "-", e.get("machine", "-"), claims,
                 f"`{e.get('command', '-')}`"]
        lines.append("| " + " | ".join(c.replace("|", "\\|").replace("\n", " ") for c in cells) + " |")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m jax_sparse_attn.bench.records",
                                description="Prints a records folder's index as a Markdown table.")
    p.add_argument("folder", nargs="?", default=str(RECORDS_DIR),
                   help=f"the records folder (default {RECORDS_DIR})")
    a = p.parse_args(argv)
    path = pathlib.Path(a.folder) / INDEX_NAME
    if not path.exists():
        p.error(f"folder: no {INDEX_NAME} in {a.folder}")
    print(format_index(read_index(path)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
