"""Verdicts with evidence an auditor can re-run: stored, exported as a bundle, and checked from the bundle alone.

A verdict's evidence is one JSON document: the criterion as written, the runs it was bound to, the SQL verbatim,
the rows it returned, the threshold, the series it read (with their labels and sample counts), the time range, and
the kvscope and DuckDB versions. Its digest is sha256 over the document's RFC 8785 canonical JSON (documents of the
first format, kvscope-evidence/1: sorted keys, no spaces, UTF-8), a newline, and the chunks of samples it read
(schema.py: each chunk is a batch of one series, hashed when it was written), in (series_id, first_ts) order, each
as series_id (little-endian int64), first_ts and last_ts (little-endian float64), its sample count (int64) and its
32-byte sha256. Every sample is covered, yet stamping a verdict reads a few rows per series rather than every
sample.

Each verdict names the verification that judged it (one `kvscope verify`, or an A/B the service ended), whose
manifest lists the criteria file and its sha256, the params and arms bound, the runs, every verdict and every
criterion it could not judge (`Verification`).

A bundle is a directory: `evidence.json` (the documents and their digests, and the manifests of their
verifications), `samples.parquet` (every sample of the series the verdicts read) and `chunks.parquet` (the chunks'
bounds, counts and hashes). `check_bundle` recomputes
every chunk's hash and count from the samples, each digest from the document and the chunks, and re-runs each SQL
on tables rebuilt from the samples alone: an edited document, an edited sample or a verdict the SQL no longer gives
is reported by name. It also recompiles each verdict's criterion, as the document records it, and holds the stored
SQL to what that compiles to (a bundle whose SQL was replaced, or whose criterion was loosened without its SQL,
is caught without a key). Each verdict must be listed, as it is, by its verification's manifest, with the same
runs, of the arms its criteria name; the verdicts a manifest lists that the bundle leaves out are reported with
their outcome, so a bundle of the passing verdicts alone still shows the failing one.

What anchors a bundle: evidence.json carries `bundle_digest`, sha256 over the RFC 8785 canonical JSON of
everything else in it (format, database, export time, every verdict id, digest and document), so anyone can
recompute it with standard tools. A forger who edits a bundle can recompute every hash too; what they cannot make
is the digest an auditor was given beside the bundle (`evidence check --expect-digest`) or the Ed25519 signature of
the key the auditor trusts (`evidence sign --key`, then `evidence check --public-key`: the signature, over the
digest's 32 bytes, is `evidence.sig`).
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
import tempfile
import time
import zipfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import duckdb
import numpy as np
import rfc8785
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from pydantic import TypeAdapter, ValidationError

from kvscope import __version__
from kvscope.units import format_bytes
from kvscope.verifier.criteria import CriteriaError, CriteriaFile, Criterion, Outcome, evaluate, plain_row
from kvscope.verifier.db import Database, Run, VerifierError, canonical_json, run_sql
from kvscope.verifier.schema import MIGRATIONS, chunk_digest, chunk_rows

BUNDLE_FORMAT = "kvscope-evidence/2"  # 2: documents digested as RFC 8785 canonical JSON, verification manifests
FIRST_FORMAT = "kvscope-evidence/1"  # documents digested as kvscope's own sorted-key JSON: still checked
VERIFICATION_FORMAT = "kvscope-verification/1"
FLOAT_TOLERANCE = 1e-9  # re-run sums of doubles may differ in the last bits (parallel aggregation order)


@dataclass(frozen=True, slots=True)
class Verdict:
    verdict_id: int
    criterion: str
    passed: bool
    summary: str
    document: dict
    digest: str


def chunks_of(con: duckdb.DuckDBPyConnection, series_ids: list[int]) -> dict[str, np.ndarray]:
    """The chunks of `series_ids` in digest order: series_id, first_ts, last_ts, samples, sha256."""
    ids = ", ".join(map(str, series_ids)) or "NULL"
    return con.execute(
        "SELECT series_id, first_ts, last_ts, samples, sha256 FROM sample_chunks "
        f"WHERE series_id IN ({ids}) ORDER BY series_id, first_ts"
    ).fetchnumpy()


def digest(document: Mapping, chunks: Mapping[str, np.ndarray]) -> str:
    """The verdict's digest: sha256 over the document's RFC 8785 canonical JSON (kvscope's sorted-key JSON for a
    document of the first format), a newline, then each chunk's bounds, count and hash."""
    if document.get("format") == FIRST_FORMAT:
        text = canonical_json(document).encode()
    else:
        text = rfc8785_bytes(document, "a verdict's document")
    sha = hashlib.sha256(text)
    sha.update(b"\n")
    for series_id, first_ts, last_ts, samples, chunk_sha in zip(
        chunks["series_id"].tolist(), chunks["first_ts"].tolist(), chunks["last_ts"].tolist(),
        chunks["samples"].tolist(), chunks["sha256"].tolist(), strict=True,
    ):  # fmt: skip
        sha.update(_CHUNK.pack(series_id, first_ts, last_ts, samples))
        sha.update(chunk_sha)
    return sha.hexdigest()


_CHUNK = struct.Struct("<qddq")


def record_verdict(db: Database, outcome: Outcome, runs: Mapping[str, Run], verification_id: int) -> Verdict:
    """Build the evidence document of `outcome`, digest it with its chunks, and store it as a verdict row of
    verification `verification_id` (Verification.judge is how a verdict is recorded)."""
    chunks = chunks_of(db.con, outcome.series_ids)
    document = {
        "format": BUNDLE_FORMAT,
        "verification_id": verification_id,
        "criterion": outcome.criterion.model_dump(mode="json", by_alias=True, exclude_defaults=False),
        "runs": {role: _run_record(r) for role, r in runs.items()},
        "passed": outcome.passed,
        "summary": summarize(outcome)
        + "".join(
            f" (run {r.name!r} never finished: judged on what it recorded)" for r in runs.values() if r.ended_at is None
        ),
        "threshold": outcome.criterion.threshold(),
        "columns": outcome.columns,
        "observed": outcome.rows,
        "sql": outcome.sql,
        "series": _series_rows(db.con, outcome.series_ids, chunks),
        "sample_count": int(chunks["samples"].sum()),
        "time_range": [float(chunks["first_ts"].min()), float(chunks["last_ts"].max())]
        if len(chunks["samples"])
        else None,
        "kvscope_version": __version__,
        "duckdb_version": duckdb.__version__,
    }
    sha = digest(document, chunks)
    (verdict_id,) = run_sql(
        db.con,
        "INSERT INTO verdicts (criterion, kind, runs, passed, evidence, digest, created_at, verification_id) "
        "VALUES (?, ?, ?, ?, ?, ?, ?, ?) RETURNING verdict_id",
        [
            outcome.criterion.name,
            outcome.criterion.kind,  # type: ignore[attr-defined]
            canonical_json({role: run.name for role, run in runs.items()}),
            outcome.passed,
            canonical_json(document),
            sha,
            time.time(),
            verification_id,
        ],
    )[0]
    return Verdict(verdict_id, outcome.criterion.name, outcome.passed, document["summary"], document, sha)


class Verification:
    """One judging of a criteria file on bound runs (`kvscope verify`, or the service when an A/B ends). Its
    verdicts carry its id; `finish` stores its manifest: the criteria file and its sha256, the params and arms
    bound, the runs, every verdict recorded and every criterion that could not be judged. A bundle carries the
    manifests of its verdicts' verifications, so one that leaves a failing verdict out still shows it."""

    def __init__(
        self,
        db: Database,
        spec: CriteriaFile,
        runs: Mapping[str, Run],
        criteria_file: Path | None,
        chunk_summaries: str = "trusted",
    ) -> None:
        self.db, self.spec, self.runs = db, spec, runs
        self.criteria_file, self.chunk_summaries = criteria_file, chunk_summaries
        self.verification_id: int = run_sql(db.con, "SELECT nextval('verification_ids')")[0][0]
        self.verdicts: list[Verdict] = []
        self.errors: list[dict[str, str]] = []

    def judge(self, criterion: Criterion) -> Verdict:
        """Evaluate and record one criterion; a CriteriaError (it could not be judged) is noted, then raised."""
        try:
            outcome = evaluate(self.db, criterion, self.runs)
        except CriteriaError as error:
            self.errors.append({"criterion": criterion.name, "error": str(error)})
            raise
        verdict = record_verdict(self.db, outcome, self.runs, self.verification_id)
        self.verdicts.append(verdict)
        return verdict

    def finish(self) -> dict:
        """Store the manifest (covered by its own digest, RFC 8785 canonical JSON); returns it."""
        path = self.criteria_file
        manifest = {
            "format": VERIFICATION_FORMAT,
            "verification_id": self.verification_id,
            "criteria": {
                "file": str(path) if path else None,
                "sha256": hashlib.sha256(path.read_bytes()).hexdigest() if path else None,
                "params": self.spec.params,
                "arms": self.spec.arms,
                "criteria": [criterion.name for criterion in self.spec.criteria],
            },
            "runs": {role: _run_record(run) for role, run in self.runs.items()},
            "verdicts": [
                {"verdict_id": v.verdict_id, "criterion": v.criterion, "passed": v.passed, "digest": v.digest}
                for v in self.verdicts
            ],
            "errors": self.errors,
            "chunk_summaries": self.chunk_summaries,
            "passed": not self.errors and all(v.passed for v in self.verdicts),
            "kvscope_version": __version__,
            "created_at": time.time(),
        }
        run_sql(
            self.db.con,
            "INSERT INTO verifications (verification_id, manifest, digest, created_at) VALUES (?, ?, ?, ?)",
            [self.verification_id, canonical_json(manifest), manifest_digest(manifest), manifest["created_at"]],
        )
        return manifest


def manifest_digest(manifest: Mapping) -> str:
    """sha256 over a verification manifest's RFC 8785 canonical JSON."""
    return hashlib.sha256(rfc8785_bytes(manifest, "a verification manifest")).hexdigest()


def rfc8785_bytes(value: Mapping, what: str) -> bytes:
    """`value`'s RFC 8785 canonical JSON, what every digest of a bundle is taken over; an input error naming `what`
    when it has no such form (a number beyond I-JSON's range, a key that is not a string)."""
    try:
        return rfc8785.dumps(value)
    except (rfc8785.CanonicalizationError, TypeError, ValueError) as error:
        raise VerifierError(f"{what} cannot be canonicalized (RFC 8785): {error}") from None


def _run_record(run: Run) -> dict:
    """What a verdict says of a run it judged: which run, where it came from, when, whether it finished (a killed
    recording has no end) and the hash of its configuration."""
    return {
        "name": run.name,
        "run_id": run.run_id,
        "arm": run.arm,
        "scenario": run.scenario,
        "origin": run.origin,
        "started_at": run.started_at,
        "ended_at": run.ended_at,
        "finished": run.ended_at is not None,
        "config_sha256": hashlib.sha256(canonical_json(run.config).encode()).hexdigest(),
    }


def summarize(outcome: Outcome) -> str:
    """One line an on-call person reads: what passed, or which rows failed and with what values."""
    if not outcome.rows:
        return "no rows: the query found nothing to judge"
    failed = [row for row in outcome.rows if not row["passed"]]
    if not failed:
        return f"passed: {len(outcome.rows)} row(s) checked"
    if (told := outcome.criterion.failure(failed)) is not None:
        return told
    columns = outcome.criterion.failure_columns()
    byte_metric = any(metric.name.endswith("bytes") for _, metric, _ in outcome.criterion.reads())
    shown = "; ".join(_describe_row(row, columns, byte_metric) for row in failed[:5])
    more = f" (and {len(failed) - 5} more)" if len(failed) > 5 else ""
    return f"failed: {len(failed)} of {len(outcome.rows)} row(s): {shown}{more}"


def _describe_row(row: Mapping, columns: tuple[str, ...], in_bytes: bool) -> str:
    """`key=value` for the row's telling columns; amounts of a byte metric also in readable units."""
    parts = []
    for key in columns:
        value = row.get(key)
        if key == "labels" and isinstance(value, Mapping):
            value = "{" + ",".join(f"{k}={v}" for k, v in sorted(value.items())) + "}"
        elif key.endswith("_ts") and isinstance(value, float):
            value = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(value))
        elif isinstance(value, int | float) and not isinstance(value, bool) and key != "round":
            integral = isinstance(value, int) or value.is_integer()
            amount = f"{int(value):,}" if integral else f"{value:,.6g}"
            if in_bytes and key not in ("relative_difference", "ratio_to_bound"):
                amount += f" B ({format_bytes(value)})"
            value = amount
        parts.append(f"{key}={value}")
    return " ".join(parts)


def _series_rows(con: duckdb.DuckDBPyConnection, series_ids: list[int], chunks: Mapping[str, np.ndarray]) -> list[dict]:
    """The series a verdict read, with their labels and how many samples each had."""
    if not series_ids:
        return []
    counts: dict[int, int] = {}
    for series_id, samples in zip(chunks["series_id"].tolist(), chunks["samples"].tolist(), strict=True):
        counts[series_id] = counts.get(series_id, 0) + samples
    result = con.execute(
        "SELECT series_id, run_id, target, source, name, kind, normalized, labels "
        f"FROM series WHERE series_id IN ({', '.join(map(str, series_ids))}) ORDER BY series_id"
    )
    columns = [c[0] for c in result.description]
    rows = [dict(zip(columns, row, strict=True)) for row in result.fetchall()]
    for row in rows:
        row["labels"] = json.loads(row["labels"])
        row["samples"] = counts.get(row["series_id"], 0)
    return rows


def export_bundle(db: Database, verdict_ids: list[int], out: Path) -> Path:
    """Write the bundle of the given verdicts (all when empty): evidence.json, samples.parquet, chunks.parquet, and
    for a reader without kvscope rerun.sql and README.md."""
    where = f"WHERE verdict_id IN ({', '.join(map(str, verdict_ids))})" if verdict_ids else ""
    rows = run_sql(db.con, f"SELECT verdict_id, evidence, digest FROM verdicts {where} ORDER BY verdict_id")
    if not rows:
        raise VerifierError(f"{db.path}: no verdicts to export" + (f" with ids {verdict_ids}" if verdict_ids else ""))
    missing = set(verdict_ids) - {row[0] for row in rows}
    if missing:
        raise VerifierError(f"{db.path}: no verdict with id {', '.join(map(str, sorted(missing)))}")
    out.mkdir(parents=True, exist_ok=True)
    verdicts = [{"verdict_id": vid, "digest": sha, "document": json.loads(doc)} for vid, doc, sha in rows]
    judged_by = sorted({v["document"].get("verification_id") for v in verdicts} - {None})
    verifications = [
        {"verification_id": vid, "digest": sha, "manifest": json.loads(manifest)}
        for vid, manifest, sha in run_sql(
            db.con,
            "SELECT verification_id, manifest, digest FROM verifications "
            f"WHERE verification_id IN ({', '.join(map(str, judged_by)) or 'NULL'}) ORDER BY verification_id",
        )
    ]
    ids = ", ".join(map(str, sorted({s["series_id"] for v in verdicts for s in v["document"]["series"]}))) or "NULL"
    for query, name in (
        (f"SELECT series_id, ts, value FROM samples WHERE series_id IN ({ids}) ORDER BY series_id, ts", SAMPLES),
        (f"SELECT {_CHUNK_COLUMNS} FROM sample_chunks WHERE series_id IN ({ids}) ORDER BY series_id, first_ts", CHUNKS),
    ):
        run_sql(db.con, f"COPY ({query}) TO {_literal(str(out / name))} (FORMAT parquet)")
    bundle = {"format": BUNDLE_FORMAT, "database": db.path, "exported_at": time.time(), "verdicts": verdicts,
              "verifications": verifications}  # fmt: skip
    bundle["bundle_digest"] = bundle_digest(bundle)
    (out / MANIFEST).write_text(json.dumps(bundle, indent=2, sort_keys=True) + "\n")
    (out / RERUN).write_text(rerun_script(verdicts))
    (out / README).write_text(BUNDLE_README)
    (out / SIGNATURE).unlink(missing_ok=True)  # a signature of an earlier export would not be of this one
    return out


def bundle_digest(bundle: Mapping) -> str:
    """sha256 over the RFC 8785 canonical JSON of evidence.json without its `bundle_digest`."""
    covered = {key: value for key, value in bundle.items() if key != "bundle_digest"}
    return hashlib.sha256(rfc8785_bytes(covered, "evidence.json")).hexdigest()


def sign_bundle(bundle: Path, key_file: Path) -> str:
    """Sign a bundle directory's digest with the Ed25519 private key in `key_file` (PEM, unencrypted, as
    `openssl genpkey -algorithm ed25519` writes it); writes evidence.sig and returns the digest signed."""
    try:
        key = serialization.load_pem_private_key(key_file.read_bytes(), password=None)
    except (OSError, ValueError, TypeError) as error:
        raise VerifierError(f"{key_file}: not an unencrypted PEM private key: {error}") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise VerifierError(f"{key_file}: not an Ed25519 key ({type(key).__name__})")
    sha = _recorded_digest(bundle)
    (bundle / SIGNATURE).write_bytes(key.sign(bytes.fromhex(sha)))
    return sha


def _read_manifest(bundle: Path) -> dict:
    """A bundle's evidence.json, with at least one verdict; anything else is an input error naming the file."""
    try:
        manifest = json.loads((bundle / MANIFEST).read_text())
        verdicts = manifest["verdicts"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise VerifierError(f"{bundle / MANIFEST}: not a kvscope evidence file: {error!r}") from None
    if not isinstance(verdicts, list) or not verdicts:
        raise VerifierError(f"{bundle / MANIFEST}: no verdicts to check")
    return manifest


def _recorded_digest(bundle: Path) -> str:
    """The bundle's digest as recomputed from its evidence.json (a bundle that does not match it is refused)."""
    document = _read_manifest(bundle)
    sha = bundle_digest(document)
    if document.get("bundle_digest") != sha:
        raise VerifierError(f"{bundle / MANIFEST}: its bundle_digest does not match its content: not signing it")
    return sha


MANIFEST, SAMPLES, CHUNKS, SIGNATURE = "evidence.json", "samples.parquet", "chunks.parquet", "evidence.sig"
RERUN, README = "rerun.sql", "README.md"  # not covered by the digest: conveniences derived from evidence.json
BUNDLE_README = f"""# A kvscope evidence bundle

- `{MANIFEST}`: the verdicts. Each document holds its criterion, runs, series, SQL and observed rows, with the
  verdict's digest; `verifications` holds the manifest of each `kvscope verify` that judged them (criteria file
  and sha256, runs, every verdict it recorded, what it could not judge), with its digest (sha256 of its RFC 8785
  canonical JSON). `bundle_digest` is the sha256 of the file's RFC 8785 canonical JSON without `bundle_digest`.
- `{SAMPLES}`: every sample the verdicts read (series_id, ts, value).
- `{CHUNKS}`: the per-batch chunk summaries the whole-run criteria read, each with the sha256 of its samples.
- `{RERUN}`: every verdict re-run by DuckDB alone.

Re-run everything with plain DuckDB, from this folder: `duckdb < {RERUN}`. It builds kvscope's tables from
`{MANIFEST}` and `{SAMPLES}`, turns file access off, and prints each verdict's recorded `passed` beside the one its
SQL computes now. Without the CLI, in Python: `import duckdb; con = duckdb.connect()`, then
`con.execute(statement)` for each statement of `open("{RERUN}").read().split(";\\n")`. The verdicts' SQL is the
bundle's own: read it first.

Re-hash: `python -c "import json, hashlib, rfc8785; b = json.load(open('{MANIFEST}')); d = b.pop('bundle_digest');
print(hashlib.sha256(rfc8785.dumps(b)).hexdigest() == d)"`. A verdict's digest is sha256 over its document's RFC
8785 JSON, a newline, then for each of its series' chunks in `{CHUNKS}` (by series_id, first_ts): series_id
(int64), first_ts and last_ts (float64), samples (int64), all little-endian, and the chunk's 32-byte sha256.

`kvscope evidence check .` does all of this and more: it recomputes every chunk hash from the samples, compiles each
criterion again and compares its SQL, and checks a digest or signature you were given apart from the bundle.
"""
MAX_BUNDLE_MEMBER_BYTES = 16 << 30  # what one file of a zipped bundle may unpack to
_CHUNK_COLUMNS = "series_id, first_ts, last_ts, samples, sha256"


@dataclass
class CheckReport:
    checked: int = 0
    problems: list[str] = field(default_factory=list)
    digest: str = ""  # the bundle's digest, recomputed (what an auditor compares with the one they were given)
    signed: bool = False  # the signature verified against the public key given
    verifications: list[dict] = field(default_factory=list)  # the manifests of the verdicts' verifications
    left_out: list[dict] = field(default_factory=list)  # verdicts a manifest lists that the bundle does not carry

    @property
    def ok(self) -> bool:
        return self.checked > 0 and not self.problems


def check_bundle(bundle: Path, expect_digest: str | None = None, public_key: Path | None = None) -> CheckReport:
    """Recompute every chunk hash, digest and verdict of a bundle from its own files; list what does not match.
    `bundle` is a directory (`evidence export`) or the zip the service serves. With `expect_digest` the bundle's
    digest must be that one; with `public_key` (PEM) its evidence.sig must be that key's signature of it."""
    if bundle.is_file():
        with tempfile.TemporaryDirectory(prefix="kvscope-bundle-") as folder:
            return check_bundle(_unzipped(bundle, Path(folder)), expect_digest, public_key)
    for name in (MANIFEST, SAMPLES, CHUNKS):
        if not (bundle / name).is_file():
            raise VerifierError(f"{bundle}: not an evidence bundle: {name} is missing")
    manifest = _read_manifest(bundle)
    verdicts = manifest["verdicts"]
    report = CheckReport(digest=bundle_digest(manifest))
    if manifest.get("bundle_digest") != report.digest:
        report.problems.append(
            "evidence.json: its bundle_digest does not match its content: the bundle was edited after export"
        )
    if expect_digest is not None and expect_digest.strip().lower() != report.digest:
        report.problems.append(f"evidence.json: digest {report.digest}, not the expected {expect_digest.strip()}")
    if public_key is not None:
        report.signed = _signature_holds(bundle, public_key, report.digest, report.problems)
    with Database(":memory:") as scratch:
        try:
            _load_bundle(scratch, verdicts, bundle)
            altered = altered_series(scratch, "bundle_chunks")
        except (KeyError, TypeError, AttributeError, ValueError) as error:  # a document without a field it needs
            raise VerifierError(f"{bundle / MANIFEST}: a verdict's document is incomplete: {error!r}") from None
        except duckdb.Error as error:  # samples.parquet or chunks.parquet that DuckDB cannot read as such
            raise VerifierError(f"{bundle}: its samples or chunks cannot be read: {error}") from None
        _lock_down(scratch)
        for verdict in verdicts:
            report.checked += 1
            try:
                report.problems += _check_verdict(scratch, verdict, altered)
            except (KeyError, TypeError, AttributeError) as error:
                raise VerifierError(f"{bundle / MANIFEST}: verdict {report.checked} is incomplete: {error!r}") from None
    try:
        _check_verifications(manifest.get("verifications", []), verdicts, report)
    except (KeyError, TypeError, AttributeError) as error:
        raise VerifierError(f"{bundle / MANIFEST}: a verification manifest is incomplete: {error!r}") from None
    return report


def _check_verifications(verifications: list[dict], verdicts: list[dict], report: CheckReport) -> None:
    """Each verdict belongs to a verification whose manifest the bundle carries, unedited, lists it as it is and
    bound the same runs (of the arms its criteria name); the verdicts a manifest lists beyond the bundle's are
    reported as left out, not as tampering (a bundle may carry one verdict, as the service's does)."""
    problems = report.problems
    manifests: dict[int, dict] = {}
    for entry in verifications:
        manifest, vid = entry["manifest"], entry["verification_id"]
        if manifest_digest(manifest) != entry["digest"] or manifest.get("verification_id") != vid:
            problems.append(f"verification {vid}: digest mismatch: its manifest was changed")
        for role, arm in manifest["criteria"]["arms"].items():
            run = manifest["runs"][role]
            if run["arm"] != arm:
                problems.append(f"verification {vid}: role {role} is bound to run {run['name']!r} of arm "
                                f"{run['arm']!r}, and its criteria need arm {arm!r}")  # fmt: skip
        manifests[vid] = manifest
        report.verifications.append(manifest)
    bundled = {verdict["verdict_id"] for verdict in verdicts}
    for verdict in verdicts:
        document, name = verdict["document"], f"verdict {verdict['verdict_id']}"
        manifest = manifests.get(document.get("verification_id"))  # type: ignore[arg-type]
        if manifest is None and document.get("format") == FIRST_FORMAT and "verification_id" not in document:
            continue  # stored before verifications had manifests: nothing lists it
        if manifest is None:
            problems.append(f"{name}: the bundle carries no manifest of the verification that judged it, so "
                            "nothing shows what else it judged")  # fmt: skip
            continue
        listed = {"verdict_id": verdict["verdict_id"], "criterion": document["criterion"]["name"],
                  "passed": document["passed"], "digest": verdict["digest"]}  # fmt: skip
        if listed not in manifest["verdicts"]:
            problems.append(f"{name}: not what verification {manifest['verification_id']}'s manifest lists")
        if document["runs"] != manifest["runs"]:
            problems.append(f"{name}: its runs are not the ones verification {manifest['verification_id']} bound")
    for manifest in manifests.values():
        report.left_out += [
            {**entry, "verification_id": manifest["verification_id"]}
            for entry in manifest["verdicts"]
            if entry["verdict_id"] not in bundled
        ]


def _signature_holds(bundle: Path, public_key: Path, sha: str, problems: list[str]) -> bool:
    """Whether evidence.sig is the key's Ed25519 signature of the digest; what is wrong goes to `problems`."""
    try:
        key = serialization.load_pem_public_key(public_key.read_bytes())
    except (OSError, ValueError, TypeError) as error:
        raise VerifierError(f"{public_key}: not a PEM public key: {error}") from None
    if not isinstance(key, Ed25519PublicKey):
        raise VerifierError(f"{public_key}: not an Ed25519 public key ({type(key).__name__})")
    if not (bundle / SIGNATURE).is_file():
        problems.append(f"{SIGNATURE}: missing: the bundle is not signed")
        return False
    try:
        key.verify((bundle / SIGNATURE).read_bytes(), bytes.fromhex(sha))
    except InvalidSignature:
        problems.append(f"{SIGNATURE}: not this key's signature of digest {sha}")
        return False
    return True


_INSERT_RUNS = (
    "INSERT INTO runs (run_id, name, arm, scenario, origin, started_at, config) VALUES (?, ?, ?, ?, 'bundle', 0, '{}')"
)
_INSERT_SERIES = "INSERT INTO series VALUES (?, ?, ?, ?, ?, ?, ?, ?)"
_INSERT_CHUNKS = f"INSERT INTO sample_chunks SELECT *, ''::BLOB FROM ({chunk_rows('samples')})"


def _insert_samples(parquet: str) -> str:
    return f"INSERT INTO samples SELECT series_id, ts, value FROM read_parquet({_literal(parquet)})"


def _bundle_rows(verdicts: list[dict]) -> tuple[list[tuple], list[tuple]]:
    """The runs and series rows a bundle's verdicts read, from their documents (_INSERT_RUNS, _INSERT_SERIES)."""
    series: dict[int, dict] = {}
    runs: dict[int, dict] = {}
    for verdict in verdicts:
        for row in verdict["document"]["series"]:
            series[row["series_id"]] = row
        for run in verdict["document"]["runs"].values():
            runs[run["run_id"]] = run
    return (
        [(run_id, r["name"], r["arm"], r["scenario"]) for run_id, r in runs.items()],
        [
            (s["series_id"], s["run_id"], s["target"], s["source"], s["name"], s["kind"], s["normalized"],
             canonical_json(s["labels"]))
            for s in series.values()
        ],
    )  # fmt: skip


def rerun_script(verdicts: list[dict]) -> str:
    """rerun.sql: a bundle's verdicts re-run by plain DuckDB from the bundle's folder (`duckdb < rerun.sql`):
    kvscope's tables made as `evidence check` makes them, from the documents and samples.parquet, then, with file
    access off, each verdict's SQL as the bundle stores it, its recorded `passed` beside the one computed now."""
    runs, series = _bundle_rows(verdicts)
    statements = [
        *MIGRATIONS,
        *(_bind(_INSERT_RUNS, row) for row in runs),
        *(_bind(_INSERT_SERIES, row) for row in series),
        _insert_samples(SAMPLES),
        _INSERT_CHUNKS,
        "SET enable_external_access = false",  # what follows is the bundle's own SQL
        "SET lock_configuration = true",
    ]
    for verdict in verdicts:
        document = verdict["document"]
        statements.append(
            f"SELECT {int(verdict['verdict_id'])} AS verdict_id, {_literal(document['criterion']['name'])} "
            f"AS criterion, {_literal(bool(document['passed']))} AS recorded_passed, "
            f"(SELECT bool_and(passed) FROM ({document['sql']})) AS passed_now"
        )
    header = (
        "-- Every verdict of this bundle re-run by plain DuckDB: from this folder, `duckdb < rerun.sql`.\n"
        "-- Made by kvscope from evidence.json: read each verdict's SQL below before running it.\n"
    )
    return header + "".join(f"{statement.strip()};\n" for statement in statements)


def _bind(sql: str, row: tuple) -> str:
    """An INSERT with its ? placeholders written out as SQL literals, in order."""
    first, *rest = sql.split("?")
    return first + "".join(_literal(value) + part for value, part in zip(row, rest, strict=True))


def _literal(value: object) -> str:
    """A SQL literal: NULL, TRUE/FALSE, a number, or a string with its quotes doubled."""
    if value is None:
        return "NULL"
    if isinstance(value, bool):
        return "TRUE" if value else "FALSE"
    if isinstance(value, int | float):
        return repr(value)
    return "'" + str(value).replace("'", "''") + "'"


def _load_bundle(db: Database, verdicts: list[dict], bundle: Path) -> None:
    """The tables a verdict's SQL reads, rebuilt from the bundle: runs and series from the documents, samples from
    samples.parquet and their chunk summaries from the samples themselves (one chunk per series merges the same);
    the recorded chunk hashes go to `bundle_chunks`."""
    runs, series = _bundle_rows(verdicts)
    db.con.executemany(_INSERT_RUNS, runs)
    db.con.executemany(_INSERT_SERIES, series)
    run_sql(db.con, _insert_samples(str(bundle / SAMPLES)))
    run_sql(db.con, _INSERT_CHUNKS)
    chunks = _literal(str(bundle / CHUNKS))
    run_sql(db.con, f"CREATE TEMP TABLE bundle_chunks AS SELECT {_CHUNK_COLUMNS} FROM read_parquet({chunks})")


def _unzipped(archive: Path, folder: Path) -> Path:
    """The bundle's files (three, and its signature if signed) out of a zip into `folder`, by their own names only
    (nothing else of the archive is written, so no member path reaches the file system) and within a size bound."""
    try:
        with zipfile.ZipFile(archive) as zipped:
            members = {info.filename: info for info in zipped.infolist()}
            for name in (MANIFEST, SAMPLES, CHUNKS, SIGNATURE):
                info = members.get(name)
                if info is None and name == SIGNATURE:  # an unsigned bundle
                    continue
                if info is None:
                    raise VerifierError(f"{archive}: not an evidence bundle: {name} is missing from the zip")
                if info.file_size > MAX_BUNDLE_MEMBER_BYTES:
                    raise VerifierError(f"{archive}: {name} unpacks to {format_bytes(info.file_size)}: too large")
                (folder / name).write_bytes(zipped.read(info))
    except (zipfile.BadZipFile, zipfile.LargeZipFile, NotImplementedError, OSError) as error:
        raise VerifierError(f"{archive}: not a readable zip of an evidence bundle: {error}") from None
    return folder


def _lock_down(db: Database) -> None:
    """From here on the scratch database runs a bundle's SQL, which is whatever the bundle's author wrote: no file,
    network or extension access (COPY TO, ATTACH, read_csv of /etc/...), and no setting may be changed back."""
    db.con.execute("SET enable_external_access = false")
    db.con.execute("SET lock_configuration = true")


def altered_series(
    db: Database, chunks_table: Literal["sample_chunks", "bundle_chunks"] = "sample_chunks", run_ids: Sequence[int] = ()
) -> dict[int, str]:
    """Series whose samples do not match their chunks in `chunks_table` (count or hash), with what is wrong; of the
    runs `run_ids` only, or of every series. Reads every sample of them: what a verdict trusted, re-derived."""
    if chunks_table not in ("sample_chunks", "bundle_chunks"):
        raise ValueError(f"no chunks table {chunks_table!r}")
    where = ""
    if run_ids:
        runs = ", ".join(str(int(run_id)) for run_id in run_ids)
        where = f"WHERE series_id IN (SELECT series_id FROM series WHERE run_id IN ({runs}))"
    samples = db.con.execute(f"SELECT series_id, ts, value FROM samples {where} ORDER BY series_id, ts").fetchnumpy()
    chunks = db.con.execute(f"SELECT {_CHUNK_COLUMNS} FROM {chunks_table} {where} ORDER BY series_id, first_ts")
    chunks = chunks.fetchnumpy()
    ids, ts, values = samples["series_id"], samples["ts"], samples["value"]
    series, starts = np.unique(ids, return_index=True)
    bounds = dict(
        zip(series.tolist(), zip(starts.tolist(), [*starts[1:].tolist(), len(ids)], strict=True), strict=True)
    )
    altered: dict[int, str] = {}
    covered: dict[int, int] = {}
    for series_id, first_ts, last_ts, count, sha in zip(
        chunks["series_id"].tolist(), chunks["first_ts"].tolist(), chunks["last_ts"].tolist(),
        chunks["samples"].tolist(), chunks["sha256"].tolist(), strict=True,
    ):  # fmt: skip
        begin, end = bounds.get(series_id, (0, 0))
        low = begin + int(np.searchsorted(ts[begin:end], first_ts, "left"))
        high = begin + int(np.searchsorted(ts[begin:end], last_ts, "right"))
        covered[series_id] = covered.get(series_id, 0) + high - low
        if high - low != count or chunk_digest(ts[low:high], values[low:high]) != sha:
            altered.setdefault(series_id, f"its samples from {first_ts:.3f} to {last_ts:.3f} do not match their hash")
    for series_id, (begin, end) in bounds.items():
        if covered.get(series_id, 0) != end - begin:
            altered.setdefault(
                series_id, f"{end - begin} samples where its chunks account for {covered.get(series_id, 0)}"
            )
    return altered


def _check_verdict(db: Database, verdict: dict, altered: dict[int, str]) -> list[str]:
    document, name = verdict["document"], f"verdict {verdict.get('verdict_id')}"
    name += f" ({document.get('criterion', {}).get('name', '?')})"
    series_ids = [s["series_id"] for s in document["series"]]
    problems = [
        f"{name}: series {sid}: {altered[sid]}: the samples were changed" for sid in series_ids if sid in altered
    ]
    ids = ", ".join(map(str, series_ids)) or "NULL"
    chunks = db.con.execute(
        f"SELECT {_CHUNK_COLUMNS} FROM bundle_chunks WHERE series_id IN ({ids}) ORDER BY series_id, first_ts"
    ).fetchnumpy()
    if digest(document, chunks) != verdict["digest"]:
        problems.append(f"{name}: digest mismatch: the document or its chunk hashes were changed")
    problems += _recompiled(document, name)
    try:
        result = db.con.execute(document["sql"])
        columns = [c[0] for c in result.description]
        rows = [plain_row(dict(zip(columns, row, strict=True))) for row in result.fetchall()]
    except duckdb.Error as error:
        return [*problems, f"{name}: its SQL no longer runs on the bundle: {error}"]
    if "passed" not in columns:
        return [*problems, f"{name}: its SQL returns no passed column, so it judges nothing"]
    if not _same_rows(rows, document["observed"]):
        problems.append(f"{name}: re-running its SQL gives different rows than the evidence records")
    passed = bool(rows) and all(row["passed"] for row in rows)
    if passed != document["passed"]:
        problems.append(f"{name}: recorded {'pass' if document['passed'] else 'fail'}, the samples say otherwise")
    return problems


_CRITERION = TypeAdapter(Criterion)


def _recompiled(document: dict, name: str) -> list[str]:
    """The verdict's criterion, as its document records it, compiled again: its SQL must be the stored one."""
    try:
        criterion = _CRITERION.validate_python(document["criterion"])
        runs = {role: Run(run["run_id"], run["name"], run["arm"], run["scenario"], "bundle", 0.0, None, {})
                for role, run in document["runs"].items()}  # fmt: skip
        compiled = criterion.sql(runs)
    except ValidationError as error:
        return [f"{name}: its criterion does not validate: {error.errors()[0]['msg']}"]
    except KeyError as error:
        return [f"{name}: its criterion judges run role {error} that the document does not bind"]
    if compiled != document["sql"]:
        return [f"{name}: its SQL is not what its criterion compiles to: the SQL or the criterion was changed"]
    return []


def _same_rows(left: list[dict], right: list[dict]) -> bool:
    if len(left) != len(right):
        return False
    for a, b in zip(left, right, strict=True):
        if a.keys() != b.keys():
            return False
        for key in a:
            x, y = a[key], b[key]
            if isinstance(x, float) and isinstance(y, int | float) and not isinstance(y, bool):
                if not math.isclose(x, y, rel_tol=FLOAT_TOLERANCE, abs_tol=FLOAT_TOLERANCE):
                    return False
            elif x != y:
                return False
    return True
